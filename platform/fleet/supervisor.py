"""The supervisor: spawns one engine process per enabled spec, watches them,
respawns the ones that die, writes their state to the database and applies admin
changes without a restart. One per host (see supervisor_lock)."""

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil
from django.db import DatabaseError, close_old_connections
from django.utils import timezone

from catalog.services import model_memory_record
from engines.client import (
    EngineClient,
    EngineError,
    connection_file,
    write_connection_file,
)
from engines.launch import spawn_engine

from .models import EngineStatus, ServerSettings
from .selectors import DesiredEngine, engines_desired
from .services import engine_state_record
from .supervisor_lock import SupervisorLock

log = logging.getLogger("roundhouse.supervisor")


@dataclass
class Timing:
    """The supervisor's clocks, in seconds (tests shorten some)."""

    poll: float = 1.0  # state poll of every engine
    reconcile: float = 2.0  # desired rows vs running processes
    unanswered: float = 15.0  # alive but silent this long: killed and respawned
    drain: float = 30.0  # a stopping engine's in-flight work may take this long
    backoff_first: float = 1.0  # respawn delay after a crash, doubling...
    backoff_max: float = 60.0  # ...up to this
    healthy_after: float = 30.0  # ready this long: the crash streak is forgotten
    crash_loop: int = 3  # crashes in a row shown as a crash loop


@dataclass
class RunningEngine:
    """One engine process the supervisor owns."""

    desired: DesiredEngine
    token: str
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    answered_at: float = 0.0
    ready_since: float | None = None
    pushed_config: str = ""
    restarts: int = 0
    crash_streak: int = 0
    respawn_at: float = 0.0
    handled_restart: object = None
    last_error: str = ""
    log_path: Path = field(default_factory=Path)
    last_state: dict = field(default_factory=dict)
    recorded_memory: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    """startup() / run() / shutdown(); SIGINT and SIGTERM make run() return."""

    def __init__(self, *, run_dir: Path, timing: Timing | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.timing = timing or Timing()
        self.lock = SupervisorLock(self.run_dir)
        self.engines: dict[int, RunningEngine] = {}
        self.stopping = threading.Event()
        self.ram_cap_mib: float | None = None

    # -- lifecycle ------------------------------------------------------------

    def startup(self) -> None:
        """Take the host lock (SupervisorRunning if taken) and hook signals."""
        self.lock.acquire()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self.stopping.set())
        log.info("supervisor %s started (run dir %s)", os.getpid(), self.run_dir)

    def run(self) -> None:
        """Reconcile and poll until a signal arrives."""
        next_reconcile = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_reconcile:
                self.reconcile()
                next_reconcile = now + self.timing.reconcile
            self.poll()
            self.stopping.wait(self.timing.poll)

    def shutdown(self) -> None:
        """Drain and stop every engine, record them stopped, release the lock."""
        log.info("supervisor stopping: draining %d engines", len(self.engines))
        engines = list(self.engines.values())
        for engine in engines:
            self._ask_to_stop(engine)
        for engine in engines:
            self._wait_stopped(engine)
            self._record(engine, status=EngineStatus.STOPPED, pid=None)
        self.engines.clear()
        self.lock.release()
        log.info("supervisor stopped")

    # -- reconcile ------------------------------------------------------------

    def reconcile(self) -> None:
        """Make the running processes match the enabled specs."""
        close_old_connections()
        try:
            desired = {item.spec_id: item for item in engines_desired()}
            cap_gib = ServerSettings.load().host_ram_cap_gib
            self.ram_cap_mib = cap_gib * 1024 if cap_gib else None
        except DatabaseError as error:
            log.warning("cannot read engine specs: %s", error)
            return
        for spec_id in list(self.engines):
            if spec_id not in desired:
                engine = self.engines.pop(spec_id)
                log.info("engine %s disabled or removed: stopping", engine.desired.name)
                self._stop(engine)
                self._record(engine, status=EngineStatus.STOPPED, pid=None)
        for spec_id, wanted in desired.items():
            engine = self.engines.get(spec_id)
            if engine is None:
                engine = RunningEngine(
                    desired=wanted,
                    token="",
                    handled_restart=wanted.restart_requested_at,
                )
                self.engines[spec_id] = engine
                self._spawn(engine)
                continue
            restart = (
                wanted.restart_requested_at is not None
                and wanted.restart_requested_at != engine.handled_restart
            )
            if restart or wanted.spawn_key != engine.desired.spawn_key:
                reason = "restart requested" if restart else "spawn settings changed"
                log.info("restarting engine %s: %s", wanted.name, reason)
                engine.handled_restart = wanted.restart_requested_at
                self._stop(engine)
                engine.desired = wanted
                engine.crash_streak = 0
                self._spawn(engine)
                continue
            engine.desired = wanted
            if (
                engine.alive
                and engine.answered_at
                and (wanted.config_key != engine.pushed_config)
            ):
                self._push_config(engine)

    def _push_config(self, engine: RunningEngine) -> None:
        config = engine.desired.config
        try:
            live = ("limits", "models", "thermal", "devices")
            self._client(engine).call(
                "configure", config={key: config[key] for key in live}
            )
        except EngineError as error:
            log.warning("configure %s failed: %s", engine.desired.name, error)
            return
        engine.pushed_config = engine.desired.config_key
        log.info("pushed new limits to engine %s", engine.desired.name)

    # -- processes ------------------------------------------------------------

    def _spawn(self, engine: RunningEngine) -> None:
        wanted = engine.desired
        engine.token = secrets.token_hex(32)
        engine.log_path = self.run_dir / "logs" / f"engine-{wanted.name}.log"
        engine.process = spawn_engine(
            config=wanted.config,
            token=engine.token,
            log_path=engine.log_path,
            spec_env=wanted.env,
        )
        write_connection_file(
            self.run_dir,
            name=wanted.name,
            port=wanted.port,
            token=engine.token,
            pid=engine.process.pid,
        )
        engine.started_at = time.monotonic()
        engine.answered_at = 0.0
        engine.ready_since = None
        engine.pushed_config = wanted.config_key
        log.info(
            "spawned engine %s (pid %s, port %s, log %s)",
            wanted.name,
            engine.process.pid,
            wanted.port,
            engine.log_path,
        )
        self._record(
            engine,
            status=EngineStatus.STARTING,
            pid=engine.process.pid,
            port=wanted.port,
            started_at=timezone.now(),
            backoff_until=None,
        )

    def _client(self, engine: RunningEngine) -> EngineClient:
        return EngineClient(
            port=engine.desired.port, token=engine.token, name=engine.desired.name
        )

    def _ask_to_stop(self, engine: RunningEngine) -> None:
        """Ask for a drained exit: in-flight requests finish first."""
        if not engine.alive:
            return
        try:
            self._client(engine).call("shutdown")
        except EngineError:
            engine.process.terminate()  # SIGTERM drains too

    def _wait_stopped(self, engine: RunningEngine) -> None:
        if engine.process is None:
            return
        try:
            engine.process.wait(self.timing.drain)
        except subprocess.TimeoutExpired:
            log.warning("engine %s did not drain in time: killing", engine.desired.name)
            engine.process.kill()
            engine.process.wait()
        connection_file(self.run_dir, engine.desired.name).unlink(missing_ok=True)

    def _stop(self, engine: RunningEngine) -> None:
        self._ask_to_stop(engine)
        self._wait_stopped(engine)

    # -- polling -----------------------------------------------------------------

    def poll(self) -> None:
        """Check every engine: respawn the dead and the silent, record the rest."""
        now = time.monotonic()
        for engine in list(self.engines.values()):
            if engine.process is None:
                if now >= engine.respawn_at:
                    self._spawn(engine)
                continue
            code = engine.process.poll()
            if code is not None:
                self._crashed(engine, f"exited with code {code}")
                continue
            try:
                state = self._client(engine).state()
            except EngineError as error:
                silent_since = engine.answered_at or engine.started_at
                if now - silent_since > self.timing.unanswered:
                    engine.process.kill()
                    engine.process.wait()
                    self._crashed(
                        engine, f"stopped answering for {now - silent_since:.0f} s"
                    )
                elif engine.answered_at:
                    log.warning("engine %s: %s", engine.desired.name, error)
                continue
            self._answered(engine, state, now)
        self._enforce_ram_cap()

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
            (model.get("idle_s", 0), engine, model["name"])
            for engine in self.engines.values()
            if engine.alive
            for model in engine.last_state.get("models", [])
            if not model.get("inflight") and not model.get("queued")
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
        try:
            self._client(engine).call("unload", model=name)
        except EngineError as error:
            log.warning("unloading %s failed: %s", name, error)
        engine.last_state["models"] = [
            m for m in engine.last_state.get("models", []) if m["name"] != name
        ]

    def _answered(self, engine: RunningEngine, state: dict, now: float) -> None:
        engine.answered_at = now
        engine.last_state = state
        phase = state.get("phase", "ready")
        if state.get("cooling_reason"):
            status = EngineStatus.COOLING
        elif phase == "loading":
            status = EngineStatus.LOADING
        else:
            status = EngineStatus.READY
        if status == EngineStatus.READY:
            engine.ready_since = engine.ready_since or now
            if now - engine.ready_since > self.timing.healthy_after:
                engine.crash_streak = 0
        for item in state.get("models", []):
            # A load's measurement does not change while the model stays resident:
            # store it once per load, not on every poll.
            measured = (item["memory_mib"], item.get("device_memory_mib", 0.0))
            if engine.recorded_memory.get(item["name"]) == measured:
                continue
            try:
                model_memory_record(
                    name=item["name"],
                    memory_mib=measured[0],
                    device_memory_mib=measured[1],
                )
                engine.recorded_memory[item["name"]] = measured
            except DatabaseError as error:
                log.warning("could not store memory of %s: %s", item["name"], error)
        self._record(
            engine,
            status=status,
            pid=engine.process.pid,
            port=engine.desired.port,
            heartbeat_at=timezone.now(),
            resident_models=[
                {
                    "name": item["name"],
                    "memory_mib": item["memory_mib"],
                    "queued": item.get("queued", 0),
                    "busy": item.get("busy", 0),
                }
                for item in state.get("models", [])
            ],
            queue_depth=int(state.get("queue_depth", 0)),
            slots_in_use=int(state.get("slots_in_use", 0)),
            cooling_reason=str(state.get("cooling_reason", "")),
            backoff_until=None,
        )

    def _crashed(self, engine: RunningEngine, why: str) -> None:
        engine.process = None
        engine.restarts += 1
        engine.crash_streak += 1
        delay = min(
            self.timing.backoff_first * 2 ** (engine.crash_streak - 1),
            self.timing.backoff_max,
        )
        engine.respawn_at = time.monotonic() + delay
        tail = _log_tail(engine.log_path)
        loop = engine.crash_streak >= self.timing.crash_loop
        engine.last_error = (
            f"{'crash loop: ' if loop else ''}{why} "
            f"({engine.crash_streak} in a row); respawning in {delay:g} s"
            + (f"\n{tail}" if tail else "")
        )
        log.error("engine %s %s", engine.desired.name, engine.last_error)
        connection_file(self.run_dir, engine.desired.name).unlink(missing_ok=True)
        self._record(
            engine,
            status=EngineStatus.CRASHED,
            pid=None,
            backoff_until=timezone.now() + timedelta(seconds=delay) if loop else None,
        )

    def _record(self, engine: RunningEngine, **fields) -> None:
        engine_state_record(
            spec_id=engine.desired.spec_id,
            restart_count=engine.restarts,
            last_error=engine.last_error,
            **fields,
        )


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - 4096, 0))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])
