"""Engines a previous supervisor left running, found and ended at start.

Engines stop by themselves when their supervisor dies (engines/runtime/serve.py watches
a lifeline pipe), but one that cannot run then (stopped, stuck in the kernel)
would keep its port and memory, and the new supervisor's engine would crash-loop
on the port. A process counts as an orphan only when its pid *and* start time
match what the supervisor wrote in the engine's connection file, so a pid reused
by another program is never touched; names and command lines are never used.
"""

import contextlib
import json
import logging
import signal
import time
from pathlib import Path

import psutil

log = logging.getLogger("roundhouse.supervisor")

# psutil derives a start time from the boot time, which the kernel recomputes
# if the clock is stepped: equal within this much is the same start.
SAME_START_S = 1.0


def orphan_engines(engines_dir: Path) -> list[psutil.Process]:
    """The orphans: processes proven to be the engines that connection files
    there list (a previous supervisor's)."""
    found = []
    for path in sorted(engines_dir.glob("*.json")):
        if path.name.endswith(".config.json"):
            continue
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
            pid, started_at = int(info["pid"]), float(info["pid_started_at"])
            process = psutil.Process(pid)
            same = abs(process.create_time() - started_at) < SAME_START_S
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            continue  # unreadable, an old format, or the process is gone
        if same and _running(process):
            found.append(process)
    return found


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_ended(processes: list[psutil.Process], timeout: float) -> list:
    """Wait until none runs (a zombie has ended); those still running."""
    deadline = time.monotonic() + timeout
    while True:
        running = [process for process in processes if _running(process)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


def orphan_engines_end(run_dir: Path, *, grace_s: float) -> list[int]:
    """End the engines a previous run left: SIGTERM (they drain), SIGKILL after
    `grace_s`; remove the previous run's connection and configuration files.
    The pids ended."""
    engines_dir = Path(run_dir) / "engines"
    orphans = orphan_engines(engines_dir)
    for process in orphans:
        log.warning(
            "engine pid %s of a previous supervisor is still running: stopping it",
            process.pid,
        )
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
            process.resume()  # a stopped process acts on SIGTERM once continued
    for process in _wait_ended(orphans, grace_s):
        log.warning("engine pid %s did not stop in %g s: killing", process.pid, grace_s)
        with contextlib.suppress(psutil.Error):
            process.kill()
    _wait_ended(orphans, 10)
    for path in engines_dir.glob("*.json"):
        path.unlink(missing_ok=True)
    return [process.pid for process in orphans]
