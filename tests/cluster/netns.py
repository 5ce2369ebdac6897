"""Hosts for the multi-host tests, on one machine: a bridge in this namespace
and one network namespace per host, each joined to the bridge by a veth pair,
with its own address and its own loopback (its engines' 127.0.0.1 is its
own). PostgreSQL and Redis are reached at the bridge's address through a
forwarder. Everything made here is named after the network's number and
removed by close(), or by the next run with that number."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], check=check, capture_output=True, text=True, timeout=30
    )


def netns_available() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "iptables"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"{tool} is not installed (.ci/run installs it)"
    return None


@dataclass
class Host:
    """One namespace: a host of the test cluster."""

    name: str
    namespace: str
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, *argv],
            capture_output=True,
            text=True,
            timeout=kwargs.pop("timeout", 60),
            **kwargs,
        )

    @property
    def hostname(self) -> str:
        return f"rh-{self.name}"

    def spawn(self, argv: list[str], *, env: dict, log: Path, cwd: Path):
        """A process of this host: in its network namespace, and in a UTS
        namespace of its own with the host's name (what a batch lease records
        as its owner's host)."""
        with open(log, "ab") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace]
                + ["unshare", "--uts", "--", "sh", "-c"]
                + ['hostname "$0" && exec "$@"', self.hostname, *argv],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        listed = ip("netns", "pids", self.namespace, check=False).stdout.split()
        return [int(pid) for pid in listed]

    def kill_all(self, signum: int = signal.SIGKILL) -> None:
        """Every process of this host, at once (a host losing power)."""
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes.clear()

    def stop_all(self, timeout: float = 60) -> None:
        """SIGTERM every process, then SIGKILL what is left after `timeout`."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()

    def cut_off(self) -> None:
        """Drop every packet in or out but on its own loopback: alive, and
        unreachable (a partition)."""
        for chain, side in (("INPUT", "-i"), ("OUTPUT", "-o")):
            for rule in ([side, "lo", "-j", "ACCEPT"], ["-j", "DROP"]):
                self.run(["iptables", "-A", chain, *rule], check=True)

    def reconnect(self) -> None:
        for chain in ("INPUT", "OUTPUT"):
            self.run(["iptables", "-F", chain], check=True)


class Network:
    """A bridge and the hosts on it (10.213.N.0/24)."""

    def __init__(self, number: int | None = None) -> None:
        self.number = number if number is not None else 20 + os.getpid() % 200
        self.prefix = f"10.213.{self.number}"
        self.bridge = f"rhbr{self.number}"
        self.gateway = f"{self.prefix}.1"
        self.hosts: dict[str, Host] = {}
        self._added = 0
        self._forwarder: subprocess.Popen | None = None

    def _namespace(self, name: str) -> str:
        return f"rh{self.number}-{name}"

    def open(self, *, forward_ports: tuple[int, ...] = (5432, 6379)) -> "Network":
        self._remove_leftovers()
        ip("link", "add", self.bridge, "type", "bridge")
        # An address of its own: a bridge left to take its ports' lowest one
        # changes it when a host is removed, and the other hosts, whose ARP
        # entries still name the old one, lose the database and Redis for
        # several seconds (an "outage" no test made).
        ip("link", "set", self.bridge, "address", f"02:52:48:00:{self.number:02x}:01")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self._forwarder = subprocess.Popen(
            [sys.executable, str(HERE / "forward.py"), self.gateway]
            + [str(port) for port in forward_ports],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        ready = self._forwarder.stdout.readline()
        if b"forwarding" not in ready:
            raise RuntimeError("the forwarder did not start")
        return self

    def add_host(self, name: str) -> Host:
        namespace = self._namespace(name)
        self._added += 1
        number = self._added + 1  # .1 is the bridge; never reused
        outer, inner = f"rhv{self.number}{name}"[:15], f"rhi{self.number}{name}"[:15]
        address = f"{self.prefix}.{number}"
        ip("netns", "add", namespace)
        # Known at once, so that close() removes it whatever fails below.
        host = self.hosts[name] = Host(name=name, namespace=namespace, address=address)
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", namespace)
        ip("link", "set", outer, "master", self.bridge)
        ip("link", "set", outer, "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", namespace, "link", "set", inner, "name", "eth0")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        return host

    def remove_host(self, name: str) -> None:
        host = self.hosts.pop(name)
        host.kill_all()
        ip("netns", "del", host.namespace, check=False)

    def close(self) -> None:
        for name in list(self.hosts):
            self.remove_host(name)
        if self._forwarder is not None:
            self._forwarder.stdin.close()
            try:
                self._forwarder.wait(10)
            except subprocess.TimeoutExpired:
                self._forwarder.kill()
        ip("link", "del", self.bridge, check=False)

    def _remove_leftovers(self) -> None:
        """What a run with this number left (it was killed before close())."""
        for line in ip("netns", "list", check=False).stdout.splitlines():
            namespace = line.split()[0] if line.split() else ""
            if namespace.startswith(f"rh{self.number}-"):
                for pid in ip("netns", "pids", namespace, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                ip("netns", "del", namespace, check=False)
        for line in ip("-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(f"rhv{self.number}"):
                ip("link", "del", name, check=False)
        ip("link", "del", self.bridge, check=False)


def node_environment(
    *,
    database_url: str,
    redis_url: str,
    run_dir: Path,
    models_dir: Path,
    root: Path,
    files_dir: Path | None = None,
) -> dict:
    """The environment of a node's processes (its own run dir, the cluster's
    database and Redis through the bridge; `files_dir`: the Batch API's files
    on storage every node shares)."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "ROUNDHOUSE_RUN_DIR": str(run_dir),
        "ROUNDHOUSE_MODELS_DIR": str(models_dir),
        "SECRET_KEY": "cluster-tests-not-secret",
        "ALLOWED_HOSTS": "*",
        "PYTHONPATH": f"{root / 'platform'}:{root}",
    }
    env.pop("ROUNDHOUSE_JOIN_TOKEN", None)
    if files_dir is not None:
        env["ROUNDHOUSE_FILES_DIR"] = str(files_dir)
    return env


def start_node(
    host: Host,
    name: str,
    *,
    env: dict,
    log_dir: Path,
    root: Path,
    join_token: str = "",
    front_port: int = 8000,
    supervisor_env: dict | None = None,
) -> dict[str, subprocess.Popen]:
    """A node's processes as an operator starts them on its host: the
    supervisor (`--node NAME`, joining with the token the first time; its
    environment is `env` with `supervisor_env` over it) and a front listening
    on the host's address."""
    supervisor_env = env | (supervisor_env or {})
    if join_token:
        supervisor_env["ROUNDHOUSE_JOIN_TOKEN"] = join_token
    return {
        "supervisor": host.spawn(
            [sys.executable, "manage.py", "supervise", "--node", name],
            env=supervisor_env,
            log=log_dir / f"{name}-supervisor.log",
            cwd=root,
        ),
        "front": host.spawn(
            [sys.executable, "-m", "roundhouse.serve", "--host", "0.0.0.0"]
            + ["--port", str(front_port)],
            env=env,
            log=log_dir / f"{name}-front.log",
            cwd=root,
        ),
    }


def start_worker(host: Host, name: str, *, env: dict, log_dir: Path, root: Path):
    """A Celery worker of the node, as the Procfile starts one."""
    return host.spawn(
        [sys.executable, "-m", "celery", "-A", "roundhouse", "worker"]
        + ["--pool", "threads", "--concurrency", "2", "--loglevel", "INFO"]
        + ["--hostname", f"{name}@%h"],
        env=env,
        log=log_dir / f"{name}.log",
        cwd=root,
    )
