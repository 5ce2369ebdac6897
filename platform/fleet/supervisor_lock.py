"""One supervisor per host: an OS file lock in the run dir, and how detached
processes are spawned portably."""

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout


class SupervisorRunning(RuntimeError):
    """Another supervisor holds the lock; the message names it."""


class SupervisorLock:
    """The host-wide supervisor lock, released by the OS if the holder dies."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "supervisor.lock"
        self.info_path = self.run_dir / "supervisor.json"
        self._lock = FileLock(self.path, timeout=0)

    def acquire(self) -> None:
        """Take the lock or raise SupervisorRunning naming the holder."""
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise SupervisorRunning(
                f"a supervisor is already running ({self.holder()}); lock: {self.path}"
            ) from None
        self.info_path.write_text(
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            ),
            encoding="utf-8",
        )

    def release(self) -> None:
        self.info_path.unlink(missing_ok=True)
        self._lock.release()

    def holder(self) -> str:
        try:
            info = json.loads(self.info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "holder unknown"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} on {info['host']}, since {since}"

    def is_held(self) -> bool:
        """Whether some process (another, or this one) holds the lock now."""
        probe = FileLock(self.path, timeout=0, is_singleton=False)
        try:
            probe.acquire(timeout=0)
        except Timeout:
            return True
        probe.release()
        return False
