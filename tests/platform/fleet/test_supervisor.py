"""`manage.py supervise` as a real process, with real engines on loopback and the
bundled MiniLM embedder. The supervisor reads and writes the test database."""

import json
import os
import signal
import socket
import stat

import psutil
import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from catalog.models import ModelConfig
from engines.wire.client import EngineClient, EngineDied, EngineUnauthorized
from engines.wire.requests import GenerateRequest
from fleet.engine_processes import Timing
from fleet.models import (
    ConcurrencySettings,
    EngineSpec,
    EngineState,
    ServerSettings,
    ThermalSettings,
)
from fleet.supervisor_lock import SupervisorLock
from tests.engines.generating import model_state
from tests.platform.fleet.live_fleet import (
    BIG_BATCH,
    EMBEDDER,
    embed_in_background,
    state_of,
    wait_until_batch_runs,
)
from tests.waiting import wait_for


def test_second_supervisor_refused_and_killed_engine_respawned(fleet):
    """One supervisor per host; a SIGKILLed engine is respawned with a fresh
    token, the restart is counted, and the request it was serving fails with
    EngineDied; a frozen engine is replaced too. The token is only in the 0600
    connection file."""
    supervisor = fleet.start()
    first_pid = fleet.ready()

    second = fleet.command()
    assert second.returncode != 0
    assert f"already running (pid {supervisor.pid}" in second.stderr
    ensure = fleet.command("--ensure")
    assert ensure.returncode == 0 and "supervisor attached" in ensure.stdout

    # The secret: a 0600 file, never argv, logs or the database.
    info_path = fleet.run_dir / "engines" / "cpu0.json"
    assert stat.S_IMODE(info_path.stat().st_mode) == 0o600
    token = json.loads(info_path.read_text())["token"]
    assert len(token) == 64
    for pid in (supervisor.pid, first_pid):
        assert token not in " ".join(psutil.Process(pid).cmdline())
    rows = [
        json.dumps(list(model.objects.values()), default=str)
        for model in (EngineSpec, EngineState, ModelConfig, ServerSettings)
    ]
    assert not any(token in row for row in rows)

    client = fleet.client()
    client.call("load", model=EMBEDDER)
    in_flight = embed_in_background(client, BIG_BATCH)
    wait_until_batch_runs(client)
    os.kill(first_pid, signal.SIGKILL)
    in_flight["thread"].join(60)
    assert isinstance(in_flight.get("error"), EngineDied), in_flight

    new_pid = fleet.ready(other_than=first_pid)
    state = state_of("cpu0")
    assert state.restart_count == 1
    assert "exited with code -9" in state.last_error
    assert fleet.client().ping().pid == new_pid
    with pytest.raises(EngineUnauthorized):  # the old run's token is dead
        EngineClient(port=state.port, token=token).ping()
    assert token not in fleet.logs()

    # An engine that is alive but silent is killed and respawned too.
    os.kill(new_pid, signal.SIGSTOP)
    fleet.ready(other_than=new_pid)
    state = state_of("cpu0")
    assert state.restart_count == 2
    assert "stopped answering" in state.last_error


@pytest.fixture
def ensured(fleet):
    """The fleet started as `supervise --ensure` starts it (in the background,
    returning once its engines answer): the pid of its engine cpu0."""
    ensure = fleet.command("--ensure")
    assert ensure.returncode == 0, ensure.stderr
    return fleet.ready()


def test_ensure_starts_the_supervisor_and_returns_once_engines_answer(fleet):
    """`supervise --ensure` with no supervisor running starts one in the
    background and returns only when the engines answer."""
    ensure = fleet.command("--ensure")
    assert ensure.returncode == 0, ensure.stderr
    assert "supervisor started" in ensure.stdout
    assert fleet.client().ping().status == "ok"  # engines answer on return


def test_limits_are_pushed_to_the_running_engine(fleet, ensured):
    """A change of the concurrency settings reaches the engine without a
    restart."""
    concurrency = ConcurrencySettings.load()
    concurrency.max_parallel_requests = 7
    concurrency.save()
    wait_for(
        lambda: fleet.client().state().limits["max_parallel_requests"] == 7,
        what="limits pushed",
    )
    assert state_of("cpu0").pid == ensured  # no restart for limits


def test_the_catalog_reaches_the_engine_and_learns_the_measured_memory(fleet, ensured):
    """A chat model of the catalog answers through the supervised engine with
    the admin's sampling defaults (max_tokens 3), and the memory its load
    measured is stored in the catalog for the next decision."""
    reply = fleet.client().generate(
        GenerateRequest(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}]
        )
    )
    assert reply.usage.completion_tokens <= 3
    measured = wait_for(
        lambda: (
            ModelConfig.objects.get(name="smollm2-135m-instruct").measured_memory_mib
        ),
        what="measured memory stored",
    )
    assert measured > 50


def test_a_hot_cpu_shows_as_cooling_until_the_threshold_is_raised(
    fleet, ensured, admin_client
):
    """A hot CPU shows as `cooling` with its reason, in the admin too, along
    with the dashboard's facts (the devices' temperatures, the engine's memory,
    its tokens generated, a chat model's slots and KV pool); raising the
    threshold in the admin resumes the engine without a restart."""
    reply = fleet.client().generate(
        GenerateRequest(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}]
        )
    )
    fleet.temperatures.write_text(json.dumps({"cpu": 93}))
    wait_for(lambda: state_of("cpu0").status == "cooling", what="cooling")
    recorded = state_of("cpu0")
    assert "CPU (cpu) at 93 °C" in recorded.cooling_reason
    assert {"device": "CPU", "celsius": 93.0} in recorded.temperatures
    assert recorded.memory_mib > 50
    assert recorded.tokens_generated >= reply.usage.completion_tokens > 0
    # The chat model's slots (auto, the default) and the KV pool they share.
    (chat,) = [
        item
        for item in recorded.resident_models
        if item["name"] == "smollm2-135m-instruct"
    ]
    assert chat["slots_auto"] is True and chat["slots"] >= 1
    assert chat["kv_pool_tokens"] >= chat["context"] > 0
    assert chat["kv_mib"] > 0
    body = admin_client.get(reverse("admin:fleet_enginespec_changelist"))
    assert "cooling (CPU (cpu) at 93 °C" in body.content.decode()
    thermal = ThermalSettings.load()
    thermal.cpu_high, thermal.cpu_resume = 99, 95
    thermal.save()
    wait_for(lambda: state_of("cpu0").status == "ready", what="resumed")
    assert state_of("cpu0").pid == ensured


def test_an_env_change_restarts_the_engine_with_that_env(fleet, ensured):
    """A new env block restarts the engine, which gets it (empty values
    honoured), and none of the web side's secrets."""
    spec = EngineSpec.objects.get(name="cpu0")
    spec.env = {"ROUNDHOUSE_PROBE": "", "OMP_NUM_THREADS": "1"}
    spec.save()
    pid = fleet.ready(other_than=ensured)
    engine_env = psutil.Process(pid).environ()
    assert engine_env["ROUNDHOUSE_PROBE"] == ""  # empty values are honoured
    assert engine_env["OMP_NUM_THREADS"] == "1"
    assert "SECRET_KEY" not in engine_env and "DATABASE_URL" not in engine_env


def test_the_admins_restart_action_restarts_the_engine(fleet, ensured, admin_client):
    """The changelist's restart action restarts the engine and is recorded in
    the engine's admin history."""
    spec = EngineSpec.objects.get(name="cpu0")
    response = admin_client.post(
        reverse("admin:fleet_enginespec_changelist"),
        {"action": "restart_engines", "_selected_action": [spec.pk]},
    )
    assert response.status_code == 302
    assert LogEntry.objects.get(object_id=str(spec.pk)).change_message == (
        "Restart requested."
    )
    fleet.ready(other_than=ensured)


def test_a_new_spec_is_spawned_and_a_disabled_one_stopped(fleet, ensured):
    """A spec created while the fleet runs gets its engine; disabled, the
    engine is stopped and its connection file removed. cpu0 runs on."""
    EngineSpec.objects.create(name="cpu1", backend="cpu", order=1)
    fleet.ready("cpu1")
    assert fleet.client("cpu1").ping().engine == "cpu1"
    cpu1_pid = state_of("cpu1").pid
    EngineSpec.objects.filter(name="cpu1").update(enabled=False)
    wait_for(lambda: state_of("cpu1").status == "stopped", what="cpu1 stopped")
    assert not psutil.pid_exists(cpu1_pid) or (
        psutil.Process(cpu1_pid).status() == psutil.STATUS_ZOMBIE
    )
    assert not (fleet.run_dir / "engines" / "cpu1.json").exists()
    assert state_of("cpu0").pid == ensured


def test_an_engine_that_cannot_start_shows_a_crash_loop(fleet, ensured, admin_client):
    """A new engine whose port is taken fails to start again and again: it
    shows a crash loop naming the cause, in the admin too; the others keep
    serving."""
    with socket.socket() as squatter:  # the port a new engine wants is taken
        squatter.bind(("127.0.0.1", fleet.base_port + 3))
        squatter.listen()
        EngineSpec.objects.create(
            name="blocked", backend="cpu", order=2, port=fleet.base_port + 3
        )
        state = wait_for(
            lambda: (s := state_of("blocked")) and s.in_crash_loop and s,
            what="crash loop",
        )
        assert "crash loop" in state.last_error
        assert "address already in use" in state.last_error.lower()
        body = admin_client.get(reverse("admin:fleet_enginespec_changelist"))
        assert "crash loop (next try" in body.content.decode()
    assert state_of("cpu0").pid == ensured  # the others kept serving


def test_sigterm_drains_in_flight_work_and_exits_cleanly(fleet):
    """SIGTERM: the request in flight completes, engines stop, exit code 0."""
    supervisor = fleet.start()
    pid = fleet.ready()
    client = fleet.client()
    client.call("load", model=EMBEDDER)
    # Work that runs for seconds (many micro-batches), well inside the
    # engine's 30 s drain on a slow machine: BIG_BATCH takes about that
    # long on two busy cores.
    work = BIG_BATCH[:1500]
    in_flight = embed_in_background(client, work)
    wait_until_batch_runs(client)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(120) == 0
    in_flight["thread"].join(60)
    assert "error" not in in_flight, in_flight
    assert in_flight["rows"].shape == (len(work), 384)
    assert not psutil.pid_exists(pid)
    assert state_of("cpu0").status == "stopped"
    assert not SupervisorLock(fleet.run_dir).is_held()


def test_host_ram_cap_evicts_the_least_recently_used_idle_model(fleet):
    """Over the shared cap (supervisor + every engine), idle models are unloaded,
    least recently used first, in whichever engine holds them."""
    EngineSpec.objects.create(name="cpu1", backend="cpu", order=1)
    fleet.start()
    fleet.ready("cpu0"), fleet.ready("cpu1")
    fleet.client("cpu0").call("load", model=EMBEDDER)  # used first: evicted first
    # The supervisor ranks idle models by the idle_s each engine reported at
    # its last state poll (once a poll interval per engine, not at the same
    # moment), so the embedder must have been idle longer than the poll
    # interval, with room to spare, before SmolLM is used for the order to
    # show in the polls. Its engine reports that idle_s: wait for the reading.
    wait_for(
        lambda: model_state(fleet, EMBEDDER).idle_s > Timing().poll + 0.5,
        what="the embedder idle for over a poll interval",
    )
    fleet.client("cpu1").generate(
        GenerateRequest(model="smollm2-135m-instruct", prompt="Hello", max_tokens=2)
    )
    server = ServerSettings.load()
    server.host_ram_cap_gib = 0.5  # far below two engines with torch loaded
    server.save()

    def unloads() -> list[str]:
        log = (fleet.run_dir / "supervisor-test.log").read_text(errors="replace")
        return [
            line.split("unloading ")[1]
            for line in log.splitlines()
            if "host-RAM cap: unloading" in line
        ]

    wait_for(lambda: len(unloads()) >= 2, what="two evictions")
    assert unloads()[:2] == [
        f"{EMBEDDER} from engine cpu0",
        "smollm2-135m-instruct from engine cpu1",
    ]
    wait_for(
        lambda: (
            not state_of("cpu0").resident_models
            and not state_of("cpu1").resident_models
        ),
        what="both unloaded",
    )
