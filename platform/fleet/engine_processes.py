"""One engine process as the supervisor holds it, and the supervisor's clocks."""

import os
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from engines.wire.replies import ModelState, StateReply

from .selectors import DesiredEngine


@dataclass
class Timing:
    """The supervisor's clocks, in seconds (tests shorten some)."""

    tick: float = 0.1  # the loop's turn
    poll: float = 1.0  # state poll of every engine
    reconcile: float = 2.0  # desired rows vs running processes
    unanswered: float = 15.0  # alive but silent this long: killed and respawned
    # A stopping engine drains for up to 30 s and flushes answers for up to 10 s
    # (engines/runtime/server.py); one still running after this is killed.
    drain: float = 45.0
    backoff_first: float = 1.0  # respawn delay after a crash, doubling...
    backoff_max: float = 60.0  # ...up to this
    healthy_after: float = 30.0  # ready this long: the crash streak is forgotten
    crash_loop: int = 3  # crashes in a row shown as a crash loop
    flush: float = 10.0  # at shutdown, the last states may take this long to write


@dataclass
class RunningEngine:
    """One engine process the supervisor owns (touched by the loop thread only;
    an operation's worker reads `process`, `token` and `desired`, which do not
    change while it runs)."""

    desired: DesiredEngine
    token: str = ""
    process: subprocess.Popen | None = None
    lifeline: int | None = None  # the pipe's write end; closed, the engine stops
    started_at: float = 0.0
    answered_at: float = 0.0
    next_poll: float = 0.0
    ready_since: float | None = None
    pushed_config: str = ""
    restarts: int = 0
    crash_streak: int = 0
    respawn_at: float = 0.0
    handled_restart: object = None
    last_error: str = ""
    log_path: Path = field(default_factory=Path)
    last_state: StateReply | None = None
    recorded_memory: dict[str, tuple[float, float]] = field(default_factory=dict)
    poll: Future | None = None
    operation: Future | None = None  # stop, restart, replace or kill
    after_operation: Callable[[], None] | None = None
    request: Future | None = None  # configure, unload or load
    next_placed_load: float = 0.0
    after_request: Callable[[bool], None] | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def resident(self) -> list[ModelState]:
        """The models its last state said it holds (none before one came)."""
        return self.last_state.models if self.last_state is not None else []


def log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of an engine's log (for a crash's message)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - 4096, 0))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])
