"""Starting and stopping engine processes: configurations too large for the
environment, environments exec would refuse, the lifeline to the supervisor,
and the bounds on stopping. Real engine processes on loopback."""

import os
import secrets
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from engines.launch.config import EngineConfig, Limits, ModelSpec
from engines.launch.environment import CONFIG_ENV, CONFIG_FILE_ENV
from engines.launch.process import SpawnError, engine_environment, spawn_engine
from engines.runtime.serve import EXIT_STUCK
from engines.wire.client import EngineClient, EngineDied, EngineError
from tests.conftest import ROOT
from tests.engines.conftest import EMBEDDER, embedder_spec, free_port, started
from tests.waiting import wait_for


class Engine:
    """An engine process started with spawn_engine, stopped at the end."""

    def __init__(self, tmp_path, config: EngineConfig, **spawn) -> None:
        self.token = secrets.token_hex(32)
        self.log_path = tmp_path / f"engine-{config.port}.log"
        self.process = spawn_engine(
            config=config, token=self.token, log_path=self.log_path, **spawn
        )
        self.client = EngineClient(port=config.port, token=self.token)

    def wait_ready(self) -> None:
        outcome = started(self.process, self.client, timeout=120)
        if outcome != "ready":
            pytest.fail(f"engine did not start ({outcome}):\n{self.log()}")

    def wait_logged(self, text: str) -> None:
        wait_for(lambda: text in self.log(), timeout=60, what=f"{text!r} logged")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


@pytest.fixture
def engines(tmp_path):
    started: list[Engine] = []

    def start(config: EngineConfig, **spawn) -> Engine:
        engine = Engine(tmp_path, config, **spawn)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.end()


def small_config(**fields) -> EngineConfig:
    return EngineConfig(name="test", port=free_port(), **fields)


def test_a_configuration_too_large_for_the_environment_goes_through_a_file(
    engines, tmp_path
):
    """Over half the system's per-variable limit, the configuration reaches the
    engine through a 0600 file the engine deletes once read; the engine runs
    with it. A small configuration travels in the environment (control)."""
    catalog = {
        f"model-{i}": ModelSpec(
            name=f"model-{i}", format="gguf", path=f"/models/{'x' * 150}/{i}.gguf"
        )
        for i in range(600)
    }
    big = small_config(models=catalog, limits=Limits(queue_limit=7))
    assert len(big.to_json()) > 100_000
    with pytest.raises(SpawnError, match="too large for the environment"):
        spawn_engine(config=big, token="t", log_path=tmp_path / "never.log")

    engine = engines(big, config_dir=tmp_path / "engines")
    engine.wait_ready()
    state = engine.client.state()
    assert state.limits["queue_limit"] == 7
    environ = psutil.Process(engine.process.pid).environ()
    assert CONFIG_ENV not in environ and CONFIG_FILE_ENV in environ
    assert list((tmp_path / "engines").iterdir()) == []  # read, then deleted

    small = engines(small_config(), config_dir=tmp_path / "engines")
    small.wait_ready()
    environ = psutil.Process(small.process.pid).environ()
    assert CONFIG_ENV in environ and CONFIG_FILE_ENV not in environ


SECRETS = {
    "REDIS_URL": "redis://:hunter2@127.0.0.1:6379/0",
    "DATABASE_URL": "postgres://roundhouse:hunter2@127.0.0.1:5432/roundhouse",
    "SECRET_KEY": "not-for-engines",
    "ROUNDHOUSE_ADMIN_PASSWORD": "hunter2",
    "HF_TOKEN": "hf_not_for_engines",
    "SOME_OTHER_SERVICE_PASSWORD": "hunter2",
}


def test_an_engine_gets_only_the_environment_it_uses(engines, monkeypatch):
    """The supervisor's environment holds the web side's secrets: a spawned
    engine's environment (as the OS holds it: /proc/<pid>/environ) has none
    of them, while what it uses of it (PATH, the thread counts) and the
    spec's env block arrive. The control: the secrets are set in the parent."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert all(os.environ[name] == value for name, value in SECRETS.items())
    spec_env = {"ROUNDHOUSE_PROBE": "", "MKL_NUM_THREADS": "1", "MY_SPEC_VAR": "v"}
    engine = engines(small_config(), spec_env=spec_env)
    engine.wait_ready()
    environ = psutil.Process(engine.process.pid).environ()
    assert not set(SECRETS) & set(environ)
    assert environ["PATH"] == os.environ["PATH"]
    assert environ["OMP_NUM_THREADS"] == "2"
    assert {name: environ[name] for name in spec_env} == spec_env
    assert environ["HF_HUB_OFFLINE"] == "1"


def test_an_environment_exec_would_refuse_is_refused_before_spawning(tmp_path):
    """A NUL in a value is named in the error; no process is started."""
    before = {child.pid for child in psutil.Process().children()}
    with pytest.raises(SpawnError, match="'BAD' contains a NUL character"):
        spawn_engine(
            config=small_config(),
            token="t",
            log_path=tmp_path / "engine.log",
            spec_env={"GOOD": "", "BAD": "a\0b"},
        )
    assert {child.pid for child in psutil.Process().children()} == before


def test_an_unknown_configuration_key_is_refused_before_spawning(tmp_path):
    """A dict configuration is read as the engine would read it."""
    config = {**small_config().to_dict(), "host": "0.0.0.0"}
    with pytest.raises(ValueError, match="host\n  Extra inputs are not permitted"):
        spawn_engine(config=config, token="t", log_path=tmp_path / "e.log")


def test_an_engine_stops_when_its_lifeline_closes(engines):
    """Closing the only write end of its lifeline (what the kernel does when the
    supervisor dies) stops the engine cleanly; an engine whose lifeline stays
    open keeps serving (control)."""
    lines = {}
    for name in ("orphan", "kept"):
        read_end, lines[name] = os.pipe()
        engine = engines(small_config(), lifeline_fd=read_end)
        os.close(read_end)
        lines[name] = (engine, lines[name])
    for engine, _ in lines.values():
        engine.wait_ready()

    orphan, orphan_line = lines["orphan"]
    os.close(orphan_line)
    assert orphan.process.wait(60) == 0
    assert "stopping (the supervisor is gone)" in orphan.log()

    kept, kept_line = lines["kept"]
    assert kept.client.ping().status == "ok"
    os.close(kept_line)
    assert kept.process.wait(60) == 0


def test_a_second_sigterm_ends_a_draining_engine_at_once(engines):
    """The first SIGTERM drains (the request in flight keeps the engine up); a
    second one exits at once, whatever is in flight."""
    engine = engines(
        small_config(models={EMBEDDER: ModelSpec.from_dict(embedder_spec())}),
    )
    engine.wait_ready()
    engine.client.call("load", model=EMBEDDER)
    texts = [f"sentence {i} about engines, batches and slots" for i in range(6000)]
    outcome = {}
    worker = threading.Thread(
        target=lambda: outcome.update(result=_embed(engine.client, texts))
    )
    worker.start()
    wait_for(lambda: engine.client.state().slots_in_use, what="the batch running")

    engine.process.send_signal(signal.SIGTERM)
    engine.wait_logged("stopping (SIGTERM)")
    assert engine.process.poll() is None  # draining: the batch is still running
    engine.process.send_signal(signal.SIGTERM)
    assert engine.process.wait(30) == 128 + signal.SIGTERM
    worker.join(30)
    assert isinstance(outcome["result"], EngineDied)


def _embed(client: EngineClient, texts: list[str]):
    try:
        return client.embed(EMBEDDER, texts)
    except EngineError as error:
        return error


HANGING_DRAIN = """
import signal, sys, threading
from engines.runtime.serve import Stopper
stopper = Stopper(1.0)
stopper.attach(lambda: None)  # a drain that never ends
signal.signal(signal.SIGTERM, stopper.on_signal)
print("ready", flush=True)
threading.Event().wait()
"""


def test_the_stop_deadline_ends_a_process_whose_drain_never_finishes():
    """After SIGTERM a process whose drain hangs exits by the deadline, with the
    code that says so."""
    process = subprocess.Popen(
        [sys.executable, "-c", HANGING_DRAIN],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == EXIT_STUCK
        assert "still running 1 s after the stop request" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_engines_number_cuda_cards_in_pci_order_unless_their_spec_says(monkeypatch):
    """An engine starts with CUDA_DEVICE_ORDER=PCI_BUS_ID (the order the
    memory probes read, which the offload plan numbers cards by), where the
    parent sets none; a spec's env block, or the parent's own setting, wins."""
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    config = small_config()
    env = engine_environment(config=config, token="t")
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    spec_env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    env = engine_environment(config=config, token="t", spec_env=spec_env)
    assert env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    assert engine_environment(config=config, token="t")["CUDA_DEVICE_ORDER"] == (
        "FASTEST_FIRST"
    )
