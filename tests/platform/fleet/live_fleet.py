"""A real supervisor (`manage.py supervise` as a child process) with real engines
on loopback, reading and writing the test database; and a switch that makes that
database unavailable to it and available again."""

import contextlib
import json
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from django.db import connection

from engines.wire.client import EngineClient
from fleet.models import EngineState
from fleet.supervisor_lock import SupervisorLock
from tests.conftest import ROOT
from tests.platform.live import database_url
from tests.waiting import wait_for

EMBEDDER = "all-minilm-l6-v2"
CHAT = "smollm2-135m-instruct"
BIG_BATCH = [
    f"sentence number {i} about engines, batches and slots" for i in range(6000)
]


def state_of(name: str) -> EngineState | None:
    return EngineState.objects.filter(spec__name=name).first()


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for its reaper has too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@dataclass
class Fleet:
    run_dir: Path
    env: dict
    base_port: int
    temperatures: Path
    processes: list = field(default_factory=list)

    def command(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "manage.py", "supervise", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self) -> subprocess.Popen:
        log = open(self.run_dir / "supervisor-test.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            [sys.executable, "manage.py", "supervise"],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.processes.append(process)
        return process

    def client(self, name: str = "cpu0") -> EngineClient:
        return EngineClient.for_engine(self.run_dir, name)

    def ready(self, name: str = "cpu0", *, other_than: int | None = None) -> int:
        """Wait until the engine is ready (with a new pid if asked); its pid."""

        def check():
            state = state_of(name)
            if state and state.status == "ready" and state.pid != other_than:
                return state.pid
            return None

        return wait_for(check, what=f"{name} ready")

    def supervisor_log(self) -> str:
        return (self.run_dir / "supervisor-test.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(
            path.read_text(errors="replace") for path in self.run_dir.rglob("*.log")
        )


def embed_in_background(client: EngineClient, texts: list[str]) -> dict:
    """Run one embed request in a thread; its outcome lands in the dict."""
    outcome: dict = {}

    def run():
        try:
            outcome["rows"] = client.embed(EMBEDDER, texts)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    outcome["thread"] = thread
    return outcome


def wait_until_batch_runs(client: EngineClient) -> None:
    wait_for(lambda: client.state().slots_in_use > 0, timeout=30, what="batch running")


class DatabaseSwitch:
    """The test database as a child process reaches it (`url`), through a path
    the test can cut: SQLite through a symbolic link (SQLite resolves it, so the
    write-ahead log is the real file's), PostgreSQL through a loopback TCP
    proxy. Cut, new connections fail and open ones are dropped."""

    def __init__(self, tmp_path: Path) -> None:
        db = connection.settings_dict
        self.sqlite = db["ENGINE"].endswith("sqlite3")
        if self.sqlite:
            self._real = Path(db["NAME"])
            self._link = tmp_path / "database-link.sqlite3"
            self._link.symlink_to(self._real)
            self.url = f"sqlite:///{self._link}"
        else:
            self._proxy = TcpProxy((db["HOST"] or "127.0.0.1", int(db["PORT"])))
            url = database_url()
            self.url = url.replace(
                f"@{db['HOST']}:{db['PORT']}/", f"@127.0.0.1:{self._proxy.port}/"
            )

    def cut(self) -> None:
        if self.sqlite:
            self._point_at(self._link.parent / "nowhere" / "database.sqlite3")
        else:
            self._proxy.cut()

    def restore(self) -> None:
        if self.sqlite:
            self._point_at(self._real)
        else:
            self._proxy.open()

    def reachable(self) -> bool:
        """Whether a new connection through the switch works."""
        if self.sqlite:
            try:
                sqlite3.connect(self._link).execute("select 1").close()
            except sqlite3.Error:
                return False
            return True
        try:
            socket.create_connection(("127.0.0.1", self._proxy.port), 2).close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        if not self.sqlite:
            self._proxy.cut()

    def _point_at(self, target: Path) -> None:
        staged = self._link.with_suffix(".staged")
        staged.unlink(missing_ok=True)
        staged.symlink_to(target)
        staged.replace(self._link)


class TcpProxy:
    """Forwards loopback connections to `target` until cut."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.open()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            doomed = [self._listener, *self._sockets] if self._listener else []
            self._listener = None
            self._sockets.clear()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                if self._listener is not listener:
                    return
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(source, sink), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def stop_leftovers(fleet: Fleet) -> None:
    """Nothing of a test may outlive it: its supervisors (the ones it started,
    and one `--ensure` started in the background, named in the lock's info
    file), then its engines."""
    for process in fleet.processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    holder = SupervisorLock(fleet.run_dir).info_path
    with contextlib.suppress(OSError, ValueError, KeyError, psutil.NoSuchProcess):
        background = psutil.Process(json.loads(holder.read_text())["pid"])
        background.terminate()
        try:
            background.wait(90)
        except psutil.TimeoutExpired:
            background.kill()
    for process in fleet.processes:
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    ports = range(fleet.base_port, fleet.base_port + 4)
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "engines.runtime.serve" in cmdline and any(
            f"--port {p}" in cmdline for p in ports
        ):
            with contextlib.suppress(psutil.Error):
                proc.resume()
                proc.kill()
