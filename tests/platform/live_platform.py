"""A live platform for tests that talk to it as clients do: `manage.py
supervise` running a real engine that serves the bundled SmolLM2 (chat) and
MiniLM (embeddings), and the front (uvicorn, as `make run` starts it), on the
test database, started once per test module that uses `live`.

Its fixtures are used by name: a module assigns them at its top
(`live = live_platform.live`, and `database`, `models_dir_path`, `orm`)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

import openai
import pytest

from api.models import ApiKey, Usage
from catalog.models import ModelConfig
from engines.wire.client import EngineClient
from fleet.models import EngineSpec, ServerSettings
from tests.conftest import ROOT
from tests.factories import ApiKeyFactory
from tests.platform.live import (
    database_url,
    free_port_block,
    front_answers,
    live_database,
)
from tests.waiting import wait_for

CHAT = "smollm2-135m-instruct"
EMBEDDER = "all-minilm-l6-v2"
UNSERVED = "tiny-transformer"  # configured, but no engine serves transformers
ENGINE = "api0"


def usage_rows(**filters) -> list[Usage]:
    return list(Usage.objects.filter(**filters).order_by("pk"))


def wait_for_usage(**filters) -> Usage:
    """The newest usage row matching, once the front has written it."""
    return wait_for(
        lambda: Usage.objects.filter(**filters).order_by("-pk").first(),
        timeout=30,
        what=f"a usage row {filters}",
    )


@dataclass
class Live:
    run_dir: Path
    port: int
    keys: dict[str, str]
    front_pid: int = 0
    # How the processes were started, and every one started (a test may
    # start the front again: it is stopped with the rest).
    env: dict = field(default_factory=dict)
    processes: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "main") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.keys.get(key, key),
            max_retries=0,
            timeout=120,
        )

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """A process of this platform (its environment, its log:
        <run dir>/../<name>.log), stopped with it unless the test stops it
        first."""
        with open(self.run_dir.parent / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.processes.append(process)
        return process

    def start_worker(self, name: str = "worker") -> subprocess.Popen:
        """A Celery worker as the Procfile starts one, on this platform's
        broker, database and run dir."""
        return self.spawn(
            name,
            [sys.executable, "-m", "celery", "-A", "roundhouse", "worker"]
            + ["--pool", "threads", "--concurrency", "2", "--loglevel", "INFO"]
            + ["--hostname", f"{name}@%h"],
        )

    def start_front(self, name: str) -> int:
        """Another front process serving this platform; its port, once it
        answers."""
        port = free_port_block(1)
        front = [sys.executable, "-m", "roundhouse.serve", "--port", str(port)]
        self.spawn(name, front)
        wait_for(lambda: front_answers(port), timeout=60, what=f"the front {name}")
        return port

    def engine(self) -> EngineClient:
        return EngineClient.for_engine(self.run_dir, ENGINE)

    def wait_engine_back(self) -> None:
        """Until the engine (killed by the test, respawned by the supervisor)
        answers an embedding through the front."""

        def answers() -> bool:
            try:
                self.client().embeddings.create(model=EMBEDDER, input="back again")
            except openai.APIStatusError:
                return False
            return True

        wait_for(answers, timeout=120, what="the respawned engine answering")

    def get(self, path: str) -> tuple[int, Message, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=30) as reply:
                return reply.status, reply.headers, reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    def post(
        self, path: str, body: bytes, *, key: str = "main", headers=None
    ) -> tuple[int, Message, dict]:
        request = urllib.request.Request(
            self.base_url + path,
            data=body,
            headers={
                "Authorization": f"Bearer {self.keys[key]}",
                "Content-Type": "application/json",
                **(headers or {}),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, reply.headers, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, error.headers, json.loads(error.read())


def _rows(base_port: int) -> dict[str, str]:
    """The module's rows: one engine, the models, one key per test need."""
    for model in (ApiKey, Usage, ModelConfig, EngineSpec):
        model.objects.all().delete()
    server = ServerSettings.load()
    server.base_port = base_port
    server.default_engine = None
    server.save()
    EngineSpec.objects.create(
        name=ENGINE, backend="cpu", capabilities=["gguf", "embedding"], order=0
    )
    ModelConfig.objects.create(
        name=CHAT,
        format="gguf",
        task="chat",
        path="SmolLM2-135M-Instruct.Q4_1.gguf",
        context_length=1024,
        slots=2,
    )
    embedder = ModelConfig.objects.create(
        name=EMBEDDER, format="embedding", task="embedding", path="all-MiniLM-L6-v2"
    )
    ModelConfig.objects.create(
        name=UNSERVED, format="transformers", task="chat", path="tiny"
    )
    keys = {
        "main": ApiKeyFactory(name="main"),
        "rpm": ApiKeyFactory(name="rpm", rpm_limit=2),
        "single": ApiKeyFactory(name="single", max_concurrent=1),
        "embed-only": ApiKeyFactory(name="embed-only", allowed_models=[embedder]),
        "revoked": ApiKeyFactory(name="revoked"),
        "fallback": ApiKeyFactory(name="fallback"),
    }
    keys["revoked"].revoked_at = keys["revoked"].created_at
    keys["revoked"].save()
    return {name: key.plaintext for name, key in keys.items()}


@contextlib.contextmanager
def start_live(
    django_db_blocker,
    tmp: Path,
    models_dir: Path,
    *,
    env: dict | None = None,
    more_rows: Callable[[], None] | None = None,
) -> Iterator[Live]:
    """The supervisor and the front on the test database, with `env` over
    the defaults (REDIS_URL unset: the front's limits in its own memory, the
    filesystem broker in the run dir) and the rows `more_rows` writes beside
    the module's; stopped and its rows deleted after."""
    base_port = free_port_block()
    with django_db_blocker.unblock():
        keys = _rows(base_port)
        if more_rows is not None:
            more_rows()
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    port = free_port_block(1)
    environment = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "ROUNDHOUSE_RUN_DIR": str(run_dir),
        "ROUNDHOUSE_MODELS_DIR": str(models_dir),
        "SECRET_KEY": "api-tests-not-secret",
        "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
    }
    environment.pop("REDIS_URL", None)
    environment.update(env or {})
    processes = []
    for name, argv in (
        ("supervisor", [sys.executable, "manage.py", "supervise"]),
        (
            "front",
            [sys.executable, "-m", "roundhouse.serve", "--port", str(port)],
        ),
    ):
        with open(tmp / f"{name}.log", "ab") as log:
            processes.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=environment,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    platform = Live(
        run_dir=run_dir,
        port=port,
        keys=keys,
        front_pid=processes[1].pid,
        env=environment,
        processes=processes,
    )

    def engines_ready():
        try:
            status, _, body = platform.get("/healthz")
        except OSError:
            return False
        return status == 200 and json.loads(body)["engines_ready"]

    try:
        wait_for(engines_ready, timeout=180, what="the front and an engine")
        yield platform
    finally:
        for process in platform.processes:
            process.send_signal(signal.SIGTERM)
        for process in platform.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        with django_db_blocker.unblock():
            for model in (Usage, ApiKey, ModelConfig, EngineSpec):
                model.objects.all().delete()


@pytest.fixture(scope="module")
def live(database, django_db_blocker, tmp_path_factory, models_dir_path):
    tmp = tmp_path_factory.mktemp("live-api")
    with start_live(django_db_blocker, tmp, models_dir_path) as platform:
        yield platform


@pytest.fixture(scope="module")
def database(django_db_setup, django_db_blocker):
    with live_database(django_db_blocker):
        yield


@pytest.fixture(scope="module")
def models_dir_path() -> Path:
    from django.conf import settings

    path = Path(settings.MODELS_DIR)
    if not (path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists():
        pytest.fail(f"bundled models missing in {path}: run `make test`")
    return path


@pytest.fixture
def orm(django_db_blocker):
    """Database access for a test of this module, without a flush afterwards."""
    with django_db_blocker.unblock():
        yield
