"""The reliability bench's faults: the platform it runs (bench/front.py's, on a
PostgreSQL database, with a supervisor that can be killed and restarted), the
engine processes it may signal, and the database it takes away.

No benchmark of its own: bench/reliability.py injects these faults under load.
"""

import asyncio
import contextlib
import secrets
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.front import ENGINE, Platform  # noqa: E402
from engines.wire.client import EngineError, read_connection_file  # noqa: E402


class EngineWatch:
    """Every engine process this run's connection file has named (the only
    engines the bench may signal), and when the named pid changed."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: dict[int, psutil.Process] = {}
        self.current: int | None = None
        self.changes: list[tuple[float, int | None]] = []

    def sample(self) -> int | None:
        try:
            info = read_connection_file(self.run_dir, ENGINE)
        except (EngineError, OSError, ValueError):
            info = {}
        pid = info.get("pid")
        if pid and pid not in self.seen:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                started = info.get("pid_started_at")
                if started is None or abs(process.create_time() - started) < 1:
                    self.seen[pid] = process
        if pid != self.current:
            self.current = pid
            self.changes.append((time.monotonic(), pid))
        return pid

    def process(self, pid: int | None) -> psutil.Process | None:
        """The engine named `pid`, if it is still that same process."""
        process = self.seen.get(pid)
        with contextlib.suppress(psutil.Error):
            if process and process.is_running():
                if "engines.runtime.serve" in " ".join(process.cmdline()):
                    return process
        return None

    def alive(self) -> list[psutil.Process]:
        return [p for pid in self.seen if (p := self.process(pid)) is not None]

    async def follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


class FaultPlatform(Platform):
    """bench/front.py's platform on a PostgreSQL database, with each process's
    output in its own log, and a supervisor that can be killed and restarted."""

    def __init__(self, run_dir: Path, database_url: str) -> None:
        super().__init__(run_dir)
        self.env["DATABASE_URL"] = database_url
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def spawn(self, argv: list[str]):
        name = "supervisor" if "supervise" in argv else "front"
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115
        original, self.log = self.log, log
        try:
            return super().spawn(argv)
        finally:
            self.log = original
            log.close()  # the child has its own copy

    @property
    def supervisor(self):
        return self.processes[0]

    @property
    def front(self):
        return self.processes[1]

    def restart_supervisor(self) -> None:
        """Start a new supervisor in the dead one's place (stop order kept)."""
        self.processes.pop(0)
        self.spawn([sys.executable, "manage.py", "supervise"])
        self.processes.insert(0, self.processes.pop())

    def fleet_rss_mib(self, engine_rss_mib: float) -> float:
        total = engine_rss_mib
        for process in (self.supervisor, self.front):
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(process.pid).memory_info().rss / 2**20
        return total


class Database:
    """A fresh PostgreSQL database for the run, and the admin statements that
    take it away and give it back."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.name = f"roundhouse_bench_{secrets.token_hex(4)}"
        parts = urlsplit(admin_url)
        self.url = parts._replace(scheme="postgres", path=f"/{self.name}").geturl()

    def execute(self, statement, params=()) -> None:
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as db:
            db.execute(statement, params)

    def _allow(self, allowed: bool) -> None:
        self.execute(
            sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
                sql.Identifier(self.name), sql.Literal(allowed)
            )
        )

    def create(self) -> None:
        self.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))

    def take_away(self) -> None:
        self._allow(False)
        self.terminate()

    def terminate(self) -> None:
        self.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (self.name,),
        )

    def give_back(self) -> None:
        self._allow(True)

    def drop(self) -> None:
        self.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(self.name)
            )
        )
