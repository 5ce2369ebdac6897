"""A batch line whose engine dies while serving it fails that line, and is
not tried again (batches.runner): the line may be what killed the engine.
Run in this process on the test database, against two real engine
processes serving SmolLM2 as replicas of one model."""

import asyncio
import os
import signal
import threading

import pytest
from django import db
from django.utils import timezone

from api.selectors import in_db_thread
from batches import runner, services
from batches.models import BatchLine
from catalog.models import ModelConfig
from engines.wire.client import write_connection_file
from fleet.models import EngineSpec, EngineState
from tests.engines.conftest import start_engine
from tests.engines.generating import SMOL, gguf_spec
from tests.factories import ApiKeyFactory
from tests.platform.api.clean_slate import close_background_connections
from tests.platform.batches.jobs import chat_line, jsonl
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _runner_connections_closed():
    """The run's connections in other threads (asgiref's, the usage writer's,
    the snapshot loader's) are closed, so the test database can be dropped."""
    yield
    asyncio.run(in_db_thread(db.connections.close_all)())
    close_background_connections()


@pytest.fixture
def replicas(settings, tmp_path):
    """Engines ra (routed first) and rb, each holding SmolLM2 (which never
    stops at its end-of-text here: the line is still decoding when ra is
    killed), recorded up and fresh as their supervisor would."""
    settings.RUN_DIR = tmp_path
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    spec = gguf_spec(
        SMOL,
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        context_length=2048,
        slots=1,
        sampling={"ignore_eos": True},
    )
    engines = [start_engine(tmp_path, models=[spec], preload=[SMOL]) for _ in "ab"]
    ModelConfig.objects.all().delete()  # the seeded catalog and engines
    EngineSpec.objects.all().delete()
    ModelConfig.objects.create(
        name=SMOL,
        format="gguf",
        task="chat",
        path="SmolLM2-135M-Instruct.Q4_1.gguf",
        replicas=2,
    )
    now = timezone.now()
    for order, (name, engine) in enumerate(zip(("ra", "rb"), engines, strict=True)):
        row = EngineSpec.objects.create(
            name=name, backend="cpu", capabilities=["gguf"], order=order
        )
        EngineState.objects.create(
            spec=row,
            status="ready",
            port=engine.port,
            started_at=now,
            heartbeat_at=now,
            resident_models=[{"name": SMOL}],
        )
        write_connection_file(tmp_path, name=name, port=engine.port, token=engine.token)
    yield engines
    for engine in engines:
        engine.stop()


def test_a_line_whose_engine_died_serving_it_fails_and_is_not_retried(replicas):
    """Engine ra is SIGKILLed while it decodes the batch's one line: the line
    is filed as failed with engine_died, and rb never gets it (before: the
    line was tried again, reached rb and was answered)."""
    a, b = replicas
    key = ApiKeyFactory()
    line = chat_line("poison", "Tell a long tale.", model=SMOL, max_tokens=2000)
    stored = services.file_store(
        key=key, chunks=[jsonl([line])], filename="in.jsonl", purpose="batch"
    )
    batch = services.batch_create(
        key=key,
        input_file_id=stored.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )

    def kill_once_decoding() -> None:
        wait_for(
            lambda: a.client().state().slots_in_use >= 1,
            timeout=60,
            what="the line decoding on ra",
        )
        os.kill(a.process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_decoding)
    killer.start()
    runner.run_batch(batch.id)
    killer.join(60)
    batch.refresh_from_db()
    assert (batch.completed, batch.failed) == (0, 1)
    record = BatchLine.objects.get(batch=batch).record
    assert record["response"]["status_code"] == 502, record
    assert record["response"]["body"]["error"]["code"] == "engine_died"
    assert b.client().state().slots_in_use == 0
