"""The supervisor under faults, as real processes: killed with SIGKILL, draining
an engine that will not finish, without its database, facing an unhealthy engine
and an engine that cannot start."""

import os
import signal
import subprocess
import sys
import threading

import psutil
from django.urls import reverse
from django.utils import timezone

from catalog.models import ModelConfig
from engines.launch.environment import CONFIG_FILE_ENV
from engines.wire.client import EngineError, connection_file, write_connection_file
from engines.wire.requests import GenerateRequest
from fleet.models import EngineSpec, ServerSettings
from fleet.selectors import routing_snapshot
from tests.platform.fleet.live_fleet import CHAT, EMBEDDER, gone, state_of
from tests.waiting import wait_for


def test_engines_end_with_a_killed_supervisor_and_the_next_ends_leftovers(fleet):
    """SIGKILL of the supervisor: its engines stop by themselves. One that
    cannot (stopped) is ended by the next supervisor, which proves it is its
    engine by pid and start time; a process listed with another start time is
    left alone, though its command line names engines.runtime.serve. The new engines
    take the same ports."""
    EngineSpec.objects.create(name="cpu1", backend="cpu", order=1)
    first = fleet.start()
    pids = {name: fleet.ready(name) for name in ("cpu0", "cpu1")}
    ports = {name: state_of(name).port for name in pids}
    os.kill(pids["cpu1"], signal.SIGSTOP)  # it cannot act on its lifeline
    first.kill()
    first.wait()
    wait_for(lambda: gone(pids["cpu0"]), timeout=90, what="cpu0 ends with it")
    assert psutil.Process(pids["cpu1"]).status() == psutil.STATUS_STOPPED

    decoy = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "engines.runtime.serve"]
    )
    write_connection_file(
        fleet.run_dir,
        name="ghost",
        port=1,
        token="not-a-token",
        pid=decoy.pid,
        pid_started_at=psutil.Process(decoy.pid).create_time() - 100,
    )
    try:
        fleet.start()
        new = {name: fleet.ready(name, other_than=pids[name]) for name in pids}
        assert gone(pids["cpu1"])
        assert decoy.poll() is None  # not proven to be an engine: untouched
        assert not connection_file(fleet.run_dir, "ghost").exists()
        assert {name: state_of(name).port for name in new} == ports
        assert "of a previous supervisor is still running" in fleet.supervisor_log()
    finally:
        decoy.kill()
        decoy.wait()


def test_a_drain_that_does_not_finish_leaves_the_other_engines_serving(
    fleet, admin_client
):
    """Restarting an engine that cannot finish its drain (frozen) does not hold
    the supervisor up: the other engine's heartbeat moves on, routing keeps it
    up and it serves, while the frozen one's heartbeat stays put (control).
    After the drain bound the frozen engine is killed and a new one started."""
    EngineSpec.objects.create(name="cpu1", backend="cpu", order=1)
    fleet.start()
    frozen = fleet.ready("cpu0")
    fleet.ready("cpu1")
    fleet.client("cpu1").call("load", model=EMBEDDER)
    os.kill(frozen, signal.SIGSTOP)
    spec = EngineSpec.objects.get(name="cpu0")
    response = admin_client.post(
        reverse("admin:fleet_enginespec_changelist"),
        {"action": "restart_engines", "_selected_action": [spec.pk]},
    )
    assert response.status_code == 302
    wait_for(lambda: state_of("cpu0").status == "stopping", what="cpu0 stopping")
    since = timezone.now()

    wait_for(
        lambda: state_of("cpu1").heartbeat_at > since, what="cpu1 heartbeat moving"
    )
    assert psutil.Process(frozen).status() == psutil.STATUS_STOPPED  # draining
    assert state_of("cpu0").heartbeat_at < since
    engines = routing_snapshot().engines
    assert engines["cpu1"].up and not engines["cpu0"].up
    assert fleet.client("cpu1").embed(EMBEDDER, ["still served"]).shape == (1, 384)

    fleet.ready("cpu0", other_than=frozen)
    assert gone(frozen)
    assert "did not drain in 45 s: killing" in fleet.supervisor_log()


def answering_pid(fleet, *, other_than: int) -> int | None:
    try:
        pid = fleet.client().ping().pid
    except EngineError:
        return None
    return pid if pid != other_than else None


def test_supervision_goes_on_while_the_database_is_unavailable(fleet, database_switch):
    """With the database unreachable the supervisor logs it once and keeps
    supervising (a killed engine is respawned and answers); nothing reaches
    the database meanwhile (control), and once it is back the new engine's
    state is written."""
    fleet.env["DATABASE_URL"] = database_switch.url
    fleet.start()
    pid = fleet.ready()
    database_switch.cut()
    assert not database_switch.reachable()
    wait_for(
        lambda: "database unavailable" in fleet.supervisor_log(),
        what="the outage noticed",
    )

    os.kill(pid, signal.SIGKILL)
    new_pid = wait_for(
        lambda: answering_pid(fleet, other_than=pid), what="respawned, answering"
    )
    assert state_of("cpu0").pid == pid

    database_switch.restore()
    assert fleet.ready(other_than=pid) == new_pid
    log = fleet.supervisor_log()
    assert log.count("database unavailable") == 1
    assert "database available again" in log


def test_an_unhealthy_engine_is_avoided_and_replaced(fleet):
    """An engine that reports itself unhealthy (generation had work and made no
    step for longer than the admin's limit) is recorded unhealthy with the
    reason, routing avoids it, and a new process replaces it. Under the default
    limit the same work leaves it healthy (control)."""
    fleet.start()
    pid = fleet.ready()
    stop = threading.Event()

    def generate() -> None:
        while not stop.is_set():
            try:
                fleet.client().generate(
                    GenerateRequest(
                        model=CHAT,
                        prompt="Once upon a time",
                        max_tokens=200,
                        ignore_eos=True,
                    )
                )
            except EngineError:
                stop.wait(0.1)

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        wait_for(lambda: fleet.client().state().slots_in_use, what="generating")
        assert fleet.client().state().healthy is True
        # Below what the admin accepts (1 s): a step in progress counts as stuck.
        ServerSettings.objects.update(stuck_after_s=0.001)
        state = wait_for(
            lambda: (s := state_of("cpu0")) and s.status == "unhealthy" and s,
            what="unhealthy",
        )
        assert state.last_error.startswith("unhealthy: the decode loop is stuck")
        assert not routing_snapshot().engines["cpu0"].up
    finally:
        stop.set()
        worker.join(60)
    ServerSettings.objects.update(stuck_after_s=60)
    fleet.ready(other_than=pid)
    state = state_of("cpu0")
    assert state.restart_count == 1
    assert "unhealthy: the decode loop is stuck" in state.last_error


def test_an_engine_that_cannot_start_leaves_the_rest_running(fleet):
    """An env block exec would refuse (written around the admin's check) fails
    that engine only: recorded crashed with the reason, retried with backoff.
    The other engine starts with a catalog too large for the environment (it
    travels in a file, deleted once read) and serves."""
    ModelConfig.objects.filter(name=CHAT).update(
        chat_template="{# " + "padding " * 20_000 + "#}{{ messages }}"
    )
    EngineSpec.objects.create(
        name="broken", backend="cpu", order=1, env={"HUGE": "x" * 200_000}
    )
    fleet.start()
    pid = fleet.ready("cpu0")
    state = wait_for(
        lambda: (s := state_of("broken")) and s.restart_count >= 2 and s,
        what="broken retried",
    )
    assert state.status == "crashed"
    assert "could not start" in state.last_error
    assert "HUGE is 200,006 bytes" in state.last_error

    reply = fleet.client().generate(
        GenerateRequest(model=CHAT, prompt="Hello", max_tokens=2)
    )
    assert reply.usage.completion_tokens <= 2
    assert CONFIG_FILE_ENV in psutil.Process(pid).environ()
    assert not (fleet.run_dir / "engines" / "cpu0.config.json").exists()
