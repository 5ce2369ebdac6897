"""A batch run that must not reach an engine: its key revoked or deleted
before it starts (batches.runner, in this process, on the test database;
the runs that answer lines are in test_batch_api and test_batch_limits)."""

import asyncio
import socket

import pytest
from django import db

from api.selectors import in_db_thread
from api.usage import usage_writer
from batches import runner, services
from batches.models import BatchLine
from tests.factories import ApiKeyFactory, ModelConfigFactory
from tests.platform.batches.jobs import chat_line, jsonl

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _runner_connections_closed():
    """The run's database calls leave a connection in asgiref's sync thread
    (a worker keeps it); this process closes it, so the test database can
    be dropped."""
    yield
    asyncio.run(in_db_thread(db.connections.close_all)())


@pytest.fixture
def batch(settings, tmp_path):
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    key = ApiKeyFactory()
    lines = [chat_line(f"q{n}", "Hi", model="any-model") for n in range(3)]
    stored = services.file_store(
        key=key, chunks=[jsonl(lines)], filename="in.jsonl", purpose="batch"
    )
    return services.batch_create(
        key=key,
        input_file_id=stored.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )


def test_a_revoked_keys_batch_files_every_line_and_fails(batch):
    """A batch whose key is revoked sends nothing: every line goes to the
    error file as `key_revoked`, and the batch fails with that code
    (control: before, it ran on the revoked key)."""
    batch.key.revoked_at = batch.key.created_at
    batch.key.save()
    runner.run_batch(batch.id)
    batch.refresh_from_db()
    assert batch.status == "failed"
    assert batch.errors[0]["code"] == "key_revoked"
    assert (batch.total, batch.completed, batch.failed) == (3, 0, 3)
    codes = {line.record["error"]["code"] for line in BatchLine.objects.all()}
    assert codes == {"key_revoked"}
    assert batch.error_file is not None and batch.output_file is None


def test_a_deleted_keys_batch_fails_at_its_run(batch):
    """A batch whose key was deleted fails with `key_deleted` and sends
    nothing (control: before, it ran with no key: any model, no usage)."""
    batch.key.delete()
    runner.run_batch(batch.id)
    batch.refresh_from_db()
    assert batch.key is None
    assert batch.status == "failed"
    assert batch.errors[0]["code"] == "key_deleted"
    assert not BatchLine.objects.exists()


def test_a_limited_keys_lines_are_not_500s_when_redis_is_down(settings, tmp_path):
    """With Redis stopped, a limited key's lines are admitted on the limits
    counted in this process and go on as usual: here to `no_engine` (no
    engine runs), never to a 500 `internal` error line (control: before, the
    ConnectionError of admission failed every line as a 500)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    settings.ROUNDHOUSE_BATCH_RETRY_S = 0.0
    model = ModelConfigFactory()
    key = ApiKeyFactory(rpm_limit=100, max_concurrent=2)
    lines = [chat_line(f"q{n}", "Hi", model=model.name) for n in range(3)]
    stored = services.file_store(
        key=key, chunks=[jsonl(lines)], filename="in.jsonl", purpose="batch"
    )
    batch = services.batch_create(
        key=key,
        input_file_id=stored.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )
    runner.run_batch(batch.id)
    usage_writer().close()  # the lines' usage rows, written before the key goes
    answers = [line.record["response"] for line in BatchLine.objects.all()]
    assert len(answers) == 3
    assert {answer["status_code"] for answer in answers} == {503}
    assert {answer["body"]["error"]["code"] for answer in answers} == {"no_engine"}
