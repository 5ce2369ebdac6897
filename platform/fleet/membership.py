"""This host as a node of a cluster, for its supervisor (`supervise --node
NAME`): it joins once (the admin's one-time token for the node's own secret,
kept 0600 in the run dir), heartbeats through the database every BEAT_S,
runs the node's relay (engines/wire/link_relay.py) that carries the other
nodes' streams to this host's engines and serves its model files, reads which
models are placed on its engines (routing/placement.py) for the supervisor to
load, and copies the files of those this host lacks from another node
(model_copies.py).

A node that cannot write its heartbeat for UNREACHABLE_AFTER_S (cut off from
the database) is taken for unreachable by the others, which route around it;
its relay then refuses new streams too: it cannot confirm that the work is
still its own. A revoked node's supervisor stops.
"""

import asyncio
import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from django.conf import settings
from django.db import DatabaseError, InterfaceError, close_old_connections

from catalog.selectors import model_files_path, model_paths
from cluster.identity import NodeIdentity, identity_read, identity_write
from cluster.models import UNREACHABLE_AFTER_S, NodeStatus
from cluster.selectors import node_peer
from cluster.services import (
    NodeRefused,
    cluster_database_check,
    node_authenticate,
    node_heartbeat,
    node_join,
)
from cluster.tls import (
    certificate_file_fingerprint,
    private_ca,
    relay_certificate,
    server_tls_context,
)
from engines.launch.devices import default_memory_probes
from engines.wire.client import EngineUnreachable, connection_file, read_connection_file
from engines.wire.link import PrivateCa
from engines.wire.link_client import Peer
from engines.wire.link_files import FileServer
from engines.wire.link_relay import Relay

from .model_copies import ModelCopies
from .selectors import routing_snapshot

log = logging.getLogger("roundhouse.cluster")

BEAT_S = 2.0
UNAVAILABLE = (DatabaseError, InterfaceError)


def hardware_now() -> dict:
    """What this host has: cores, RAM, and GPUs with their memory (from the
    probes the engines use: nvidia-smi, sysfs, or the test's file)."""
    cards = [
        card
        for probe in default_memory_probes(settings.ROUNDHOUSE_DEVICE_MEMORY_FILE)
        for card in probe.read()
    ]
    return {
        "cores": psutil.cpu_count() or 0,
        "ram_mib": round(psutil.virtual_memory().total / 2**20),
        "gpus": [
            {
                "names": sorted(card.names),
                "vendor": card.vendor,
                "memory_mib": round(card.total_mib),
            }
            for card in cards
        ],
    }


def _link_security(ca: PrivateCa | None, tls) -> str:
    if ca is not None:
        return "mutual TLS, private CA"
    return "TLS, pinned certificate" if tls is not None else "plain TCP"


def software_version() -> str:
    """The code this node runs: the checkout's commit when it has one."""
    head = Path(settings.BASE_DIR) / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref = (head.parent / ref[5:]).read_text().strip()
        return ref[:12]
    except OSError:
        return "unknown"


class Membership:
    """join() / start() / placed / revoked / stop()."""

    def __init__(self, *, name: str, run_dir: Path) -> None:
        self.name = name
        self.run_dir = Path(run_dir)
        self.identity: NodeIdentity | None = None
        self.revoked = threading.Event()
        # Engine name -> the models placed on it (the supervisor loads them).
        self.placed: dict[str, frozenset[str]] = {}
        self._beat_ok = time.monotonic()
        self._unavailable = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._relay: Relay | None = None
        self._relay_ready = threading.Event()
        self._relay_error: BaseException | None = None
        # The relay's database work (checking a calling node) runs here, off
        # its event loop, on one connection.
        self._db = ThreadPoolExecutor(1, thread_name_prefix="relay-db")
        self._engines: dict[str, tuple[tuple, tuple[int, str]]] = {}
        self._tls_fingerprint = ""
        self._ca: PrivateCa | None = None
        self._bind = ("", 0)
        self.copies: ModelCopies | None = None

    # -- lifecycle ----------------------------------------------------------------

    def join(self) -> None:
        """Prove this host is the node (joining first with the one-time token
        when it has no identity yet) and beat once; NodeRefused or
        ClusterUnavailable when it cannot."""
        cluster_database_check()
        identity = identity_read(self.run_dir)
        if identity is None or identity.name != self.name:
            token = settings.ROUNDHOUSE_JOIN_TOKEN
            if not token:
                raise NodeRefused(
                    f"this host has not joined as node {self.name!r}: run the join "
                    "command the admin showed for it (ROUNDHOUSE_JOIN_TOKEN=...)"
                )
            identity = node_join(name=self.name, join_token=token)
            identity_write(self.run_dir, identity)
            log.info("joined the cluster as node %s", self.name)
        node = node_authenticate(name=identity.name, secret=identity.secret)
        self.identity = identity
        self._ca = private_ca()
        self.copies = ModelCopies(
            node=identity.name, secret=identity.secret, ca=self._ca
        )
        if self._ca is not None:
            self._tls_fingerprint = certificate_file_fingerprint(self._ca.cert)
        elif settings.ROUNDHOUSE_CLUSTER_TLS:
            *_, self._tls_fingerprint = relay_certificate(self.run_dir, self.name)
        node_heartbeat(
            identity=identity,
            hardware=hardware_now(),
            version=software_version(),
            tls_fingerprint=self._tls_fingerprint,
        )
        self._beat_ok = time.monotonic()
        self._bind = (settings.ROUNDHOUSE_RELAY_BIND or node.address, node.relay_port)

    def start(self) -> None:
        """Start the relay (RelayStartError-free: a relay that cannot listen
        raises here) and the heartbeat."""
        relay_thread = threading.Thread(target=self._relay_main, name="relay")
        relay_thread.start()
        self._threads.append(relay_thread)
        self._relay_ready.wait(30)
        if self._relay_error is not None:
            raise self._relay_error
        beat_thread = threading.Thread(target=self._beat_main, name="heartbeat")
        beat_thread.start()
        self._threads.append(beat_thread)

    def stop(self) -> None:
        self._stopping.set()
        if self._loop is not None and self._relay is not None:
            with contextlib.suppress(RuntimeError, TimeoutError):  # loop ended
                if self.copies is not None:
                    self._loop.call_soon_threadsafe(self.copies.close)
                closing = asyncio.run_coroutine_threadsafe(
                    self._relay.close(), self._loop
                )
                closing.result(5)
                self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(10)
        self._db.submit(close_old_connections).result(5)
        self._db.shutdown(wait=False)

    # -- the heartbeat ---------------------------------------------------------------

    def _beat_main(self) -> None:
        # Beats start BEAT_S apart whatever a beat's reads took (a slow one on
        # a busy host does not push the next write later).
        next_beat = time.monotonic()
        while not self._stopping.is_set():
            self.beat()
            next_beat = max(next_beat + BEAT_S, time.monotonic())
            self._stopping.wait(next_beat - time.monotonic())
        close_old_connections()

    def beat(self) -> None:
        """One heartbeat, and what the cluster says back: revocations (this
        node's: stop; another's: drop its links) and this node's placement."""
        try:
            close_old_connections()
            node_heartbeat(identity=self.identity, copies=self.copies.report())
            self._beat_ok = time.monotonic()
            snapshot = routing_snapshot()
        except NodeRefused as refused:
            log.error("node %s: %s; stopping", self.name, refused.message)
            self.revoked.set()
            return
        except UNAVAILABLE as error:
            if not self._unavailable:
                log.error(
                    "node %s cannot reach the database (%s): the others take it "
                    "for unreachable after %g s, and its relay stops taking "
                    "streams then",
                    self.name,
                    str(error).strip() or type(error).__name__,
                    UNREACHABLE_AFTER_S,
                )
            self._unavailable = True
            return
        if self._unavailable:
            log.warning("node %s reaches the database again", self.name)
            self._unavailable = False
        revoked = {
            name
            for name, node in snapshot.nodes.items()
            if node.status == NodeStatus.REVOKED
        }
        if revoked and self._loop is not None and self._relay is not None:
            self._loop.call_soon_threadsafe(self._relay.drop_links, revoked)
        placed: dict[str, set[str]] = {}
        for model in snapshot.models:
            for engine in snapshot.placed(model):
                if snapshot.engines[engine].node == self.name:
                    placed.setdefault(engine, set()).add(model)
        self.placed = {engine: frozenset(models) for engine, models in placed.items()}
        self._copy_missing(snapshot)

    def _copy_missing(self, snapshot) -> None:
        """Start copying the files of models placed here that this host lacks,
        from the serving nodes, those holding the model resident first."""
        placed = set().union(*self.placed.values()) if self.placed else set()
        try:
            paths = model_paths(placed)
        except UNAVAILABLE:
            return
        wanted = {model: path for model, path in paths.items() if not path.exists()}
        others = [
            node
            for node in snapshot.nodes.values()
            if node.serving and node.name != self.name and node.host
        ]
        peers: dict[str, list[Peer]] = {}
        for model in wanted:
            holders = {
                engine.node
                for engine in snapshot.engines.values()
                if model in engine.resident
            }
            first = sorted(
                others, key=lambda node: (node.name not in holders, node.name)
            )
            peers[model] = [node_peer(node) for node in first]
        if self._loop is not None:
            self.copies.want(wanted, peers, self._loop)

    def serving(self) -> str | None:
        """Why the relay takes no streams now, or None."""
        if self.revoked.is_set():
            return f"node {self.name} is revoked"
        silent = time.monotonic() - self._beat_ok
        if silent > UNREACHABLE_AFTER_S:
            return (
                f"node {self.name} cannot confirm its place in the cluster (no "
                f"heartbeat written for {silent:.0f} s)"
            )
        return None

    # -- the relay ---------------------------------------------------------------------

    @property
    def relay_address(self) -> tuple[str, int]:
        return self._bind

    def links_of(self, node: str) -> int:
        return self._relay.links_of(node) if self._relay is not None else 0

    def _relay_main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self._relay = Relay(
            node=self.name,
            authenticate=self._authenticate,
            engine_address=self._engine_address,
            serving=self.serving,
            files=FileServer(self._model_path),
        )
        tls = None
        if self._ca is not None:
            tls = server_tls_context(self._ca.key, self._ca.cert, client_ca=self._ca.ca)
        elif self._tls_fingerprint:
            key, cert, _ = relay_certificate(self.run_dir, self.name)
            tls = server_tls_context(key, cert)
        host, port = self._bind
        try:
            loop.run_until_complete(self._relay.start(host, port, tls=tls))
        except OSError as error:
            self._relay_error = OSError(
                f"node {self.name}'s relay cannot listen on {host}:{port}: {error}"
            )
            self._relay_ready.set()
            loop.close()
            return
        log.info(
            "node %s relay listening on %s:%d (%s)",
            self.name,
            host,
            port,
            _link_security(self._ca, tls),
        )
        self._relay_ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _authenticate(self, node: str, secret: str) -> str | None:
        def check() -> str | None:
            close_old_connections()
            try:
                node_authenticate(name=node, secret=secret)
            except NodeRefused as refused:
                log.warning("relay refused a link: %s", refused.message)
                return refused.message
            return None

        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._db, check)
        except UNAVAILABLE:
            return f"node {self.name} cannot check callers now (database unavailable)"

    async def _model_path(self, model: str) -> Path | None:
        """A model of the catalog by name: its path on this host."""

        def read() -> Path | None:
            close_old_connections()
            return model_files_path(model)

        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._db, read)
        except UNAVAILABLE:
            return None

    def _engine_address(self, engine: str) -> tuple[int, str] | None:
        """An engine of this host: its port and token, from its connection
        file (read again only when the file changed)."""
        path = connection_file(self.run_dir, engine)
        try:
            info = os.stat(path)
        except (FileNotFoundError, ValueError):
            return None
        signature = (info.st_ino, info.st_mtime_ns, info.st_size)
        cached = self._engines.get(engine)
        if cached is None or cached[0] != signature:
            try:
                data = read_connection_file(self.run_dir, engine)
            except (EngineUnreachable, ValueError, KeyError):
                return None
            cached = signature, (int(data["port"]), str(data["token"]))
            self._engines[engine] = cached
        return cached[1]
