"""The supervisor's one database thread: it reads the engines wanted and writes
what the supervisor saw, so that a slow or unavailable database never holds up
the supervisor's loop.

Writes are coalesced: for each engine only the latest fields wait to be written
(a later record updates an earlier one that has not been written yet). When the
database is unavailable the recorder logs it once, keeps what it could not write
and tries again; the loop keeps supervising meanwhile, on the last engines it
read. When the database is back, the latest state of every engine is written and
that is logged too.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.db import DatabaseError, InterfaceError, close_old_connections

from catalog.services import model_memory_record
from engines.wire.replies import StateReply

from .loop_errors import LoopErrors
from .models import ServerSettings
from .selectors import DesiredEngine, engines_desired
from .services import engine_state_record

log = logging.getLogger("roundhouse.supervisor")

UNAVAILABLE = (DatabaseError, InterfaceError)  # InterfaceError: connection gone


# What the engine reports of a generation model's slots (engines.backends.memory
# SlotPlan.describe), recorded with its memory.
SLOT_PLAN_FIELDS = (
    "slots",
    "slots_auto",
    "context",
    "kv_pool_tokens",
    "kv_mib",
    "kv_groups",
    "kv_streams",
)


def resident_models_of(state: StateReply) -> list[dict]:
    """An engine state's resident models as EngineState records them."""
    return [
        {
            "name": item.name,
            "memory_mib": item.memory_mib,
            "queued": item.queued,
            "busy": item.busy,
            # How long it has been idle, and may stay so (None: no limit):
            # when it would be unloaded (Ollama's /api/ps).
            "idle_s": item.idle_s,
            "keep_alive_s": item.keep_alive_s,
            # A generation model's slots and the KV pool they share.
            **{
                field: getattr(item, field)
                for field in SLOT_PLAN_FIELDS
                if getattr(item, field) is not None
            },
            # A GGUF model's layers on the engine's cards (OffloadState).
            **({"offload": item.offload.model_dump()} if item.offload else {}),
            # Measured: its tokens/s and what its load took on each card.
            **{
                field: getattr(item, field)
                for field in ("tokens_per_s", "device_cards_mib")
                if getattr(item, field)
            },
        }
        for item in state.models
    ]


@dataclass(frozen=True)
class Desired:
    """One read of what should run: the enabled engines and the host-RAM cap."""

    engines: tuple[DesiredEngine, ...]
    ram_cap_mib: float | None
    version: int


class Recorder:
    """start() / record() / memory() / desired / close()."""

    def __init__(
        self,
        *,
        read_every: float,
        retry_every: float = 1.0,
        node: str | None = None,
        errors: LoopErrors | None = None,
    ) -> None:
        self.read_every = read_every
        self.errors = errors or LoopErrors()
        self.node = node  # whose engines to read (None: a one-host platform's)
        self.retry_every = retry_every
        self.desired: Desired | None = None  # the latest successful read
        self._states: dict[int, dict] = {}
        self._memory: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._idle = threading.Event()
        self._unavailable = False
        self._next_read = 0.0  # monotonic time of the next read: at once
        self._thread = threading.Thread(target=self._run, name="database", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def record(self, spec_id: int, **fields) -> None:
        """Queue fields of an engine's state (EngineState columns)."""
        with self._lock:
            self._states.setdefault(spec_id, {}).update(fields)
            self._idle.clear()
        self._wake.set()

    def memory(self, name: str, memory_mib: float, device_memory_mib: float) -> None:
        """Queue the memory a load measured for a catalog model."""
        with self._lock:
            self._memory[name] = (memory_mib, device_memory_mib)
            self._idle.clear()
        self._wake.set()

    def close(self, *, timeout: float) -> bool:
        """Write what is queued (up to `timeout` s), then stop; True if all was."""
        if not self._thread.is_alive():
            return not (self._states or self._memory)
        self._wake.set()
        written = self._idle.wait(timeout)
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=max(timeout, 1.0))
        return written

    @property
    def available(self) -> bool:
        return not self._unavailable

    # -- the thread --------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The thread runs (or was never started, or was closed)."""
        return (
            self._thread.is_alive()
            or self._thread.ident is None
            or self._closing.is_set()
        )

    def _run(self) -> None:
        # Any error of one pass is recorded (logged once, shown in the admin
        # on a cluster) and the pass is tried again after retry_every.
        while not self._closing.is_set():
            failed = True
            with self.errors.guard("database"):
                self._pass()
                failed = False
            if failed:
                self._closing.wait(self.retry_every)
        close_old_connections()

    def _pass(self) -> None:
        """Read the desired engines when due, write what is queued, wait."""
        now = time.monotonic()
        if now >= self._next_read:
            self._next_read = now + (
                self.read_every if self._read() else self.retry_every
            )
        if not self._write():
            self._closing.wait(self.retry_every)
            return
        with self._lock:
            if not self._states and not self._memory:
                self._idle.set()
        self._wake.wait(max(self._next_read - time.monotonic(), 0.0))
        self._wake.clear()

    def _read(self) -> bool:
        def read() -> Desired:
            cap_gib = ServerSettings.load().host_ram_cap_gib
            version = self.desired.version + 1 if self.desired else 1
            return Desired(
                engines=tuple(engines_desired(node=self.node)),
                ram_cap_mib=cap_gib * 1024 if cap_gib else None,
                version=version,
            )

        desired = self._attempt(read, "read the engines wanted")
        if desired is None:
            return False
        self.desired = desired
        return True

    def _write(self) -> bool:
        """Write everything queued; False (all of it kept) when unavailable."""
        with self._lock:
            states, self._states = self._states, {}
            memory, self._memory = self._memory, {}
        written: list[int] = []

        def write() -> bool:
            for spec_id, fields in states.items():
                engine_state_record(spec_id=spec_id, **fields)
                written.append(spec_id)
            for name, (memory_mib, device_mib) in list(memory.items()):
                model_memory_record(
                    name=name, memory_mib=memory_mib, device_memory_mib=device_mib
                )
                del memory[name]
            return True

        if not states and not memory:
            return True
        if self._attempt(write, "write the engines' state"):
            return True
        with self._lock:  # keep what was not written, under anything newer
            for spec_id, fields in states.items():
                if spec_id not in written:
                    self._states[spec_id] = {**fields, **self._states.get(spec_id, {})}
            for name, measured in memory.items():
                self._memory.setdefault(name, measured)
        return False

    def _attempt(self, work: Callable, what: str):
        """Run `work` on a usable connection; None when the database is not."""
        try:
            close_old_connections()  # a broken or expired one is replaced
            result = work()
        except UNAVAILABLE as error:
            if not self._unavailable:
                log.error(
                    "database unavailable, could not %s (%s): still supervising; "
                    "retrying every %g s",
                    what,
                    str(error).strip() or type(error).__name__,
                    self.retry_every,
                )
            self._unavailable = True
            return None
        if self._unavailable:
            log.warning("database available again: writing the engines' state")
            self._unavailable = False
        return result
