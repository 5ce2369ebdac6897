"""The supervisor: spawns one engine process per enabled spec, watches them,
respawns the ones that die, writes their state to the database and applies admin
changes without a restart. One per host (see supervisor_lock).

One loop thread owns every RunningEngine and never waits on an engine or on the
database: each tick it collects what has finished and starts what is due.
- Each engine's `state` is polled in a worker thread, one poll per engine at a
  time, so a slow engine delays no other engine's heartbeat.
- Stopping, restarting and replacing an engine (a drain, bounded, then a kill)
  is that engine's *operation*, run in a worker thread; meanwhile the loop
  neither polls, respawns nor kills that engine, and the others carry on.
- Live changes (`configure`) and the RAM cap's unloads are *requests* made
  beside the engine's polls.
- The database is read and written by one thread (recorder.py); an outage is
  logged once and supervision goes on with the engines last read.
Engines get a lifeline pipe, so they stop when the supervisor dies however it
dies; at start, engines a previous supervisor left running are ended first
(orphans.py).
"""

import contextlib
import logging
import os
import resource
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from datetime import timedelta
from pathlib import Path

import psutil
from django.db.models.functions import Now
from django.utils import timezone

from engines.launch.config import LiveConfig
from engines.launch.process import spawn_engine
from engines.wire.client import (
    EngineClient,
    EngineError,
    connection_file,
    write_connection_file,
)
from engines.wire.replies import StateReply

from .engine_processes import RunningEngine, Timing, log_tail
from .loop_errors import LoopErrors
from .membership import Membership
from .models import EngineStatus
from .orphans import orphan_engines_end
from .recorder import Recorder, resident_models_of
from .selectors import DesiredEngine
from .supervisor_lock import SupervisorLock

log = logging.getLogger("roundhouse.supervisor")

# A model placed on an engine whose load failed is tried again after this long.
PLACED_LOAD_RETRY_S = 10.0
# The exit code of a supervisor one of whose loop threads (the database
# thread, the heartbeat, the relay) stopped: its process manager (systemd's
# Restart=on-failure, `make run`'s fleet_ensure) starts it again.
LOOP_STOPPED_EXIT = 75
# The open files the supervisor asks for (up to the hard limit): its relay,
# engine connections, database and log files share one process.
OPEN_FILES_WANTED = 65536


def open_files_raise() -> int:
    """Raise this process's soft limit of open files towards the hard limit
    (OPEN_FILES_WANTED at most); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = (
        OPEN_FILES_WANTED
        if hard == resource.RLIM_INFINITY
        else min(hard, OPEN_FILES_WANTED)
    )
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    return soft


class Supervisor:
    """startup() / run() / shutdown(); SIGINT and SIGTERM make run() return."""

    def __init__(
        self, *, run_dir: Path, timing: Timing | None = None, node: str | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.timing = timing or Timing()
        self.lock = SupervisorLock(self.run_dir)
        # Its loops' errors: each logged once, shown on the node's admin page.
        self.errors = LoopErrors()
        self.recorder = Recorder(
            read_every=self.timing.reconcile, node=node, errors=self.errors
        )
        # On a cluster: this host's node (join, heartbeat, relay, placement).
        self.membership = (
            Membership(name=node, run_dir=self.run_dir, errors=self.errors)
            if node is not None
            else None
        )
        # Not None once the supervisor ends because a loop thread stopped.
        self.exit_code: int | None = None
        self.workers = ThreadPoolExecutor(max_workers=64, thread_name_prefix="engine")
        self.engines: dict[int, RunningEngine] = {}
        self.stopping = threading.Event()
        self.ram_cap_mib: float | None = None
        self._desired_version = 0
        self._next_ram_check = 0.0

    # -- lifecycle ------------------------------------------------------------

    def startup(self) -> None:
        """Take the host lock (SupervisorRunning if taken), hook signals, end a
        previous run's leftover engines, start the database thread."""
        self.lock.acquire()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self.stopping.set())
        log.info(
            "supervisor %s started (run dir %s, %s open files at most)",
            os.getpid(),
            self.run_dir,
            open_files_raise(),
        )
        if self.membership is not None:
            try:
                self.membership.join()  # NodeRefused, ClusterUnavailable
                self.membership.start()
            except BaseException:
                self.lock.release()
                raise
        orphan_engines_end(self.run_dir, grace_s=self.timing.drain)
        self.recorder.start()

    def run(self) -> None:
        """Supervise until a signal arrives."""
        while not self.stopping.is_set():
            # Any error of one pass is recorded and the next pass comes.
            with self.errors.guard("reconcile"):
                self.tick()
            self._notice_stopped_loops()
            self.stopping.wait(self.timing.tick)

    def _notice_stopped_loops(self) -> None:
        """A loop thread that ended (it never should: each survives its
        errors) ends the supervisor with LOOP_STOPPED_EXIT, for its process
        manager to start it again, rather than running on half there."""
        stopped = None if self.recorder.alive else "database"
        if stopped is None and self.membership is not None:
            stopped = self.membership.stopped_loop()
        if stopped is not None:
            log.critical(
                "the supervisor's %s thread stopped: exiting with code %d to be "
                "started again",
                stopped,
                LOOP_STOPPED_EXIT,
            )
            self.exit_code = LOOP_STOPPED_EXIT
            self.stopping.set()

    def tick(self) -> None:
        """One turn of the loop; never waits on an engine or the database."""
        now = time.monotonic()
        desired = self.recorder.desired
        if desired is not None and desired.version != self._desired_version:
            self._desired_version = desired.version
            self.ram_cap_mib = desired.ram_cap_mib
            self.reconcile(desired.engines)
        for engine in list(self.engines.values()):
            self._advance(engine, now)
            self._load_placed(engine, now)
        if self.membership is not None and self.membership.revoked.is_set():
            self.stopping.set()
        if now >= self._next_ram_check:
            self._next_ram_check = now + self.timing.poll
            self._enforce_ram_cap()

    def shutdown(self) -> None:
        """Drain and stop every engine at once, record them stopped, release the
        lock."""
        engines = list(self.engines.values())
        log.info("supervisor stopping: draining %d engines", len(engines))
        wait_all([engine.operation for engine in engines if engine.operation])
        stops = []
        for engine in engines:
            if engine.alive:
                self._record(engine, status=EngineStatus.STOPPING)
                stops.append(self.workers.submit(self._drain_and_end, engine))
        wait_all(stops)
        for engine in engines:
            self._ended(engine)
            self._record(engine, status=EngineStatus.STOPPED, pid=None)
        self.engines.clear()
        if not self.recorder.close(timeout=self.timing.flush):
            log.warning("database unavailable: the engines' last state is not saved")
        if self.membership is not None:
            self.membership.stop()
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.lock.release()
        log.info("supervisor stopped")

    # -- reconcile ------------------------------------------------------------

    def reconcile(self, wanted: Iterable[DesiredEngine]) -> None:
        """Make the running processes match the enabled specs. An engine in the
        middle of an operation is left alone: the next read looks at it again."""
        desired = {item.spec_id: item for item in wanted}
        for spec_id, engine in list(self.engines.items()):
            if spec_id not in desired and engine.operation is None:
                log.info("engine %s disabled or removed: stopping", engine.desired.name)
                self._stop(engine, then=lambda engine=engine: self._removed(engine))
        for spec_id, wanted_engine in desired.items():
            engine = self.engines.get(spec_id)
            if engine is None:
                engine = RunningEngine(
                    desired=wanted_engine,
                    handled_restart=wanted_engine.restart_requested_at,
                )
                self.engines[spec_id] = engine
                self._spawn(engine)
            elif engine.operation is None:
                self._reconcile_one(engine, wanted_engine)

    def _reconcile_one(self, engine: RunningEngine, wanted: DesiredEngine) -> None:
        restart = (
            wanted.restart_requested_at is not None
            and wanted.restart_requested_at != engine.handled_restart
        )
        if restart or wanted.spawn_key != engine.desired.spawn_key:
            reason = "restart requested" if restart else "spawn settings changed"
            log.info("restarting engine %s: %s", wanted.name, reason)
            engine.handled_restart = wanted.restart_requested_at

            def respawn() -> None:
                engine.desired = wanted
                engine.crash_streak = 0
                self._spawn(engine)

            if engine.process is None:
                respawn()
            else:
                self._stop(engine, then=respawn)
            return
        engine.desired = wanted
        if (
            engine.alive
            and engine.answered_at
            and engine.request is None
            and wanted.config_key != engine.pushed_config
        ):
            self._push_config(engine)

    def _push_config(self, engine: RunningEngine) -> None:
        key = engine.desired.config_key
        # Only what `configure` changes live (LiveConfig); the rest needs a restart.
        live = LiveConfig.of(engine.desired.config)

        def pushed(ok: bool) -> None:
            if ok:
                engine.pushed_config = key
                log.info("pushed new settings to engine %s", engine.desired.name)

        self._ask(engine, "configure", pushed, config=live.to_dict())

    # -- processes ------------------------------------------------------------

    def _spawn(self, engine: RunningEngine) -> None:
        """Start the engine's process (an error fails this engine only: it is
        recorded as a crash and retried with backoff)."""
        wanted = engine.desired
        engine.token = secrets.token_hex(32)
        engine.log_path = self.run_dir / "logs" / f"engine-{wanted.name}.log"
        engine.started_at = engine.next_poll = time.monotonic()
        engine.answered_at = 0.0
        engine.ready_since = None
        engine.pushed_config = wanted.config_key
        read_end = None
        if os.name == "posix":
            read_end, engine.lifeline = os.pipe()
        try:
            engine.process = spawn_engine(
                config=wanted.config,
                token=engine.token,
                log_path=engine.log_path,
                spec_env=wanted.env,
                config_dir=self.run_dir / "engines",
                lifeline_fd=read_end,
            )
        except Exception as error:  # noqa: BLE001 - any failure is this engine's
            log.exception("could not start engine %s", wanted.name)
            self._crashed(engine, f"could not start: {error}")
            return
        finally:
            if read_end is not None:
                os.close(read_end)
        pid = engine.process.pid
        started_at = None
        with contextlib.suppress(psutil.Error):
            started_at = psutil.Process(pid).create_time()
        write_connection_file(
            self.run_dir,
            name=wanted.name,
            port=wanted.port,
            token=engine.token,
            pid=pid,
            pid_started_at=started_at,
        )
        log.info(
            "spawned engine %s (pid %s, port %s, log %s)",
            wanted.name,
            pid,
            wanted.port,
            engine.log_path,
        )
        self._record(
            engine,
            status=EngineStatus.STARTING,
            pid=pid,
            port=wanted.port,
            started_at=Now(),
            backoff_until=None,
        )

    def _client(self, engine: RunningEngine) -> EngineClient:
        return EngineClient(
            port=engine.desired.port, token=engine.token, name=engine.desired.name
        )

    def _stop(self, engine: RunningEngine, *, then: Callable[[], None]) -> None:
        """Drain and end the engine beside the loop, then `then()` on the loop."""
        if engine.alive:
            self._record(engine, status=EngineStatus.STOPPING)

        def stopped() -> None:
            self._ended(engine)
            then()

        self._begin(engine, self._drain_and_end, then=stopped)

    def _removed(self, engine: RunningEngine) -> None:
        self._record(engine, status=EngineStatus.STOPPED, pid=None)
        self.engines.pop(engine.desired.spec_id, None)

    def _ended(self, engine: RunningEngine) -> None:
        """Forget the engine's process (ended and reaped)."""
        engine.process = None
        engine.poll = None
        if engine.lifeline is not None:
            os.close(engine.lifeline)
            engine.lifeline = None
        connection_file(self.run_dir, engine.desired.name).unlink(missing_ok=True)

    # -- operations: beside the loop, one per engine ---------------------------

    def _begin(
        self,
        engine: RunningEngine,
        work: Callable[[RunningEngine], None],
        *,
        then: Callable[[], None],
    ) -> None:
        engine.poll = None  # a poll in flight is of no interest any more
        engine.after_operation = then
        engine.operation = self.workers.submit(work, engine)

    def _finish(self, engine: RunningEngine) -> None:
        operation, engine.operation = engine.operation, None
        then, engine.after_operation = engine.after_operation, None
        if operation.exception() is not None:
            log.error(
                "engine %s: operation failed: %r",
                engine.desired.name,
                operation.exception(),
            )
        if then is not None:
            then()

    def _drain_and_end(self, engine: RunningEngine) -> None:
        """Ask for a drained exit (SIGTERM if it does not answer); kill it if
        still running after the drain bound. In a worker thread."""
        process = engine.process
        if process is None or process.poll() is not None:
            return
        try:
            self._client(engine).call("shutdown")
        except EngineError:
            process.terminate()  # SIGTERM drains too
        try:
            process.wait(self.timing.drain)
        except subprocess.TimeoutExpired:
            log.warning(
                "engine %s did not drain in %g s: killing",
                engine.desired.name,
                self.timing.drain,
            )
            self._kill(engine)

    def _kill(self, engine: RunningEngine) -> None:
        """SIGKILL and reap. In a worker thread."""
        process = engine.process
        if process is None:
            return
        process.kill()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            log.error("engine pid %s survives SIGKILL", process.pid)

    # -- requests: beside the polls ------------------------------------------------

    def _load_placed(self, engine: RunningEngine, now: float) -> None:
        """On a cluster, load a model placed on this engine that it does not
        hold yet (one at a time; a failed load is tried again later; one whose
        files are still being copied here waits for them)."""
        if (
            self.membership is None
            or engine.request is not None
            or engine.operation is not None
            or engine.ready_since is None
            or now < engine.next_placed_load
        ):
            return
        held = {item.name for item in engine.resident}
        copies = self.membership.copies
        copying = copies.missing() if copies is not None else frozenset()
        missing = sorted(
            self.membership.placed.get(engine.desired.name, frozenset())
            - held
            - copying
        )
        if missing:
            engine.next_placed_load = now + PLACED_LOAD_RETRY_S
            log.info(
                "engine %s: loading %s (placed here)", engine.desired.name, missing[0]
            )
            self._ask(engine, "load", lambda ok: None, model=missing[0])

    def _ask(
        self,
        engine: RunningEngine,
        kind: str,
        then: Callable[[bool], None],
        **fields,
    ) -> None:
        engine.after_request = then
        engine.request = self.workers.submit(self._client(engine).call, kind, **fields)

    def _answered_request(self, engine: RunningEngine) -> None:
        request, engine.request = engine.request, None
        then, engine.after_request = engine.after_request, None
        error = request.exception()
        if error is not None:
            log.warning("engine %s: %s", engine.desired.name, error)
        if then is not None:
            then(error is None)

    # -- polling ------------------------------------------------------------------

    def _advance(self, engine: RunningEngine, now: float) -> None:
        """Move one engine on: finished work, respawn, exit, poll."""
        if engine.operation is not None:
            if engine.operation.done():
                self._finish(engine)
            return
        if engine.request is not None and engine.request.done():
            self._answered_request(engine)
        if engine.process is None:
            if now >= engine.respawn_at:
                self._spawn(engine)
            return
        if engine.poll is not None:
            if engine.poll.done():
                self._polled(engine, now)
            return
        code = engine.process.poll()
        if code is not None:
            self._crashed(engine, f"exited with code {code}")
        elif now >= engine.next_poll:
            engine.next_poll = now + self.timing.poll
            engine.poll = self.workers.submit(self._client(engine).state)

    def _polled(self, engine: RunningEngine, now: float) -> None:
        poll, engine.poll = engine.poll, None
        try:
            state = poll.result()
        except Exception as error:  # noqa: BLE001 - EngineError, or a bad answer
            code = engine.process.poll()
            if code is not None:
                self._crashed(engine, f"exited with code {code}")
                return
            silent_since = engine.answered_at or engine.started_at
            if now - silent_since > self.timing.unanswered:
                why = f"stopped answering for {now - silent_since:.0f} s"
                self._begin(engine, self._kill, then=lambda: self._crashed(engine, why))
            elif engine.answered_at:
                log.warning("engine %s: %s", engine.desired.name, error)
            return
        self._answered(engine, state, now)

    def _enforce_ram_cap(self) -> None:
        """Over the shared host-RAM cap (supervisor + all engines), unload the
        least recently used idle model, in whichever engine holds it; one per
        poll, so the next poll measures the effect first."""
        if not self.ram_cap_mib:
            return
        me = psutil.Process()
        used = me.memory_info().rss
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                used += child.memory_info().rss
        used_mib = used / 2**20
        if used_mib <= self.ram_cap_mib:
            return
        idle = [
            (model.idle_s, engine, model.name)
            for engine in self.engines.values()
            if engine.alive and engine.operation is None and engine.request is None
            for model in engine.resident
            if not model.inflight and not model.queued
        ]
        if not idle:
            return
        _, engine, name = max(idle, key=lambda item: item[0])
        log.warning(
            "fleet uses %.0f MiB, over the %.0f MiB host-RAM cap: unloading %s "
            "from engine %s",
            used_mib,
            self.ram_cap_mib,
            name,
            engine.desired.name,
        )
        self._ask(engine, "unload", lambda ok: None, model=name)
        kept = [model for model in engine.resident if model.name != name]
        engine.last_state = engine.last_state.model_copy(update={"models": kept})

    def _answered(self, engine: RunningEngine, state: StateReply, now: float) -> None:
        engine.answered_at = now
        engine.last_state = state
        if not state.healthy:
            self._unhealthy(engine, state.unhealthy_reason or "no reason")
            return
        if state.cooling_reason:
            status = EngineStatus.COOLING
        elif state.phase == "loading":
            status = EngineStatus.LOADING
        else:
            status = EngineStatus.READY
        if status == EngineStatus.READY:
            engine.ready_since = engine.ready_since or now
            if now - engine.ready_since > self.timing.healthy_after:
                engine.crash_streak = 0
        for item in state.models:
            # A load's measurement does not change while the model stays resident:
            # store it once per load, not on every poll.
            measured = (item.memory_mib, item.device_memory_mib)
            if engine.recorded_memory.get(item.name) != measured:
                self.recorder.memory(item.name, *measured)
                engine.recorded_memory[item.name] = measured
        self._record(
            engine,
            status=status,
            pid=engine.process.pid,
            port=engine.desired.port,
            heartbeat_at=Now(),  # the database's clock: see fleet.selectors
            resident_models=resident_models_of(state),
            queue_depth=state.queue_depth,
            slots_in_use=state.slots_in_use,
            cooling_reason=state.cooling_reason,
            temperatures=[t.model_dump() for t in state.temperatures],
            memory_mib=state.rss_mib,
            tokens_generated=state.tokens_generated,
            backoff_until=None,
        )

    def _unhealthy(self, engine: RunningEngine, reason: str) -> None:
        """The engine says it cannot serve (its decode loop died or is stuck):
        shown as unhealthy, so routing avoids it, while it drains; then it is
        respawned like a crashed engine."""
        why = f"unhealthy: {reason}"
        log.error("engine %s is %s: replacing it", engine.desired.name, why)
        engine.last_error = why
        self._record(
            engine,
            status=EngineStatus.UNHEALTHY,
            pid=engine.process.pid,
            heartbeat_at=Now(),  # the database's clock: see fleet.selectors
        )
        self._begin(
            engine,
            self._drain_and_end,
            then=lambda: self._crashed(engine, why),
        )

    def _crashed(self, engine: RunningEngine, why: str) -> None:
        self._ended(engine)
        engine.restarts += 1
        engine.crash_streak += 1
        delay = min(
            self.timing.backoff_first * 2 ** (engine.crash_streak - 1),
            self.timing.backoff_max,
        )
        engine.respawn_at = time.monotonic() + delay
        tail = log_tail(engine.log_path)
        loop = engine.crash_streak >= self.timing.crash_loop
        engine.last_error = (
            f"{'crash loop: ' if loop else ''}{why} "
            f"({engine.crash_streak} in a row); respawning in {delay:g} s"
            + (f"\n{tail}" if tail else "")
        )
        log.error("engine %s %s", engine.desired.name, engine.last_error)
        self._record(
            engine,
            status=EngineStatus.CRASHED,
            pid=None,
            backoff_until=timezone.now() + timedelta(seconds=delay) if loop else None,
        )

    def _record(self, engine: RunningEngine, **fields) -> None:
        self.recorder.record(
            engine.desired.spec_id,
            restart_count=engine.restarts,
            last_error=engine.last_error,
            **fields,
        )
