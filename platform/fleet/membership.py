"""This host as a node of a cluster, for its supervisor (`supervise --node
NAME`): it joins once (the admin's one-time token for the node's own secret,
kept 0600 in the run dir), heartbeats through the database every BEAT_S,
runs the node's relay (platform/node_link/relay.py) that carries the other
nodes' streams to this host's engines and serves its model files, reads which
models are placed on its engines (routing/placement.py) for the supervisor to
load, and copies the files of those this host lacks from another node
(model_copies.py).

Each heartbeat it also links to every other node's relay (peer_links.py)
and writes how long each link has failed: a node every other node fails to
link to is unreachable for placement too. A node that cannot write its
heartbeat for UNREACHABLE_AFTER_S (cut off from the database) is taken for
unreachable by the others, which route around it; its relay then refuses new
streams too (it cannot confirm that the work is still its own), unless its
links say the database is down for everyone it reaches: then it serves on,
as do its fronts (cluster/peers_reached.py). A revoked node's supervisor
stops.
"""

import asyncio
import contextlib
import hmac
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from django.conf import settings
from django.db import DatabaseError, InterfaceError, close_old_connections
from node_link.client import LinkPool, Peer
from node_link.files import FileServer, model_digests
from node_link.protocol import PrivateCa
from node_link.relay import NodeRelay, link_proof

from catalog.models import ModelPathError
from catalog.selectors import (
    model_file_digests,
    model_file_digests_writable,
    model_files_path,
    model_paths_checked,
    models_without_digests,
)
from catalog.services import model_file_digests_record
from cluster.identity import NodeIdentity, identity_read, identity_write
from cluster.models import UNREACHABLE_AFTER_S
from cluster.peers_reached import PeersReached, peers_reached_write
from cluster.selectors import node_link_proofs, node_peer, node_row_readable
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
from routing.placement import copy_sources
from routing.select import Snapshot

from .disk import disk_report
from .file_removals import files_removals_follow
from .loop_errors import LoopErrors
from .model_copies import ModelCopies
from .outages import OutageClock
from .peer_links import PeerLinks, Reckoning
from .selectors import routing_snapshot

log = logging.getLogger("roundhouse.cluster")

BEAT_S = 2.0
# The relay tells its peers (in each PONG) that this node reaches the
# database while its last heartbeat succeeded this recently: a beat stuck on
# a database gone silent is not waited out (its timeouts take seconds), so a
# peer in the same outage learns it is everyone's before its own front gives
# up on its view (UNREACHABLE_AFTER_S).
DATABASE_FRESH_S = BEAT_S + 1.5
# The links to the peers are reckoned this often (peer_links.py): a change
# reaches this host's fronts (the peers file) within it.
PEER_ROUND_S = 1.0
UNAVAILABLE = (DatabaseError, InterfaceError)


def hardware_now() -> dict:
    """What this host has: cores, RAM (and how much is available), GPUs with
    their memory total and free (from the probes the engines use: nvidia-smi,
    sysfs, or the test's file), and its disk for models (fleet/disk.py:
    measured at most every 30 s; a model that cannot be read is left out)."""
    cards = [
        card
        for probe in default_memory_probes(settings.ROUNDHOUSE_DEVICE_MEMORY_FILE)
        for card in probe.read()
    ]
    memory = psutil.virtual_memory()
    return {
        "cores": psutil.cpu_count() or 0,
        "ram_mib": round(memory.total / 2**20),
        "ram_free_mib": round(memory.available / 2**20),
        "gpus": [
            {
                "names": sorted(card.names),
                "vendor": card.vendor,
                "memory_mib": round(card.total_mib),
                "free_mib": round(card.free_mib),
            }
            for card in cards
        ],
        "disk": disk_report(),
    }


def _permission_denied(error: BaseException) -> bool:
    """A database error for lack of privilege (SQLSTATE 42501)."""
    return getattr(error.__cause__, "sqlstate", None) == "42501"


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

    def __init__(
        self, *, name: str, run_dir: Path, errors: LoopErrors | None = None
    ) -> None:
        self.name = name
        # The errors of its loops (and the supervisor's), sent with each beat.
        self.errors = errors or LoopErrors()
        self.run_dir = Path(run_dir)
        self.identity: NodeIdentity | None = None
        self.revoked = threading.Event()
        # Engine name -> the models placed on it (the supervisor loads them).
        self.placed: dict[str, frozenset[str]] = {}
        self._beat_ok = time.monotonic()
        self._unavailable = False
        self._outages = OutageClock()
        # The links to the other nodes (made in join()), the peers of the last
        # view of the cluster, and the last reckoning of them written for
        # this host's fronts.
        self.peers: PeerLinks | None = None
        self._peer_rounds: asyncio.Task | None = None
        self._reached: PeersReached | None = None
        # Node -> the proof (secret hash) it was last known by: callers are
        # checked against these while the database is down.
        self._known_proofs: dict[str, str] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._relay: NodeRelay | None = None
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
        # Whether this host's database credentials may record the catalog's
        # file digests (a front's may, a node role's may not), and the models
        # being hashed for that.
        self._records_digests = False
        self._hashing: set[str] = set()

    # -- lifecycle ----------------------------------------------------------------

    def join(self) -> None:
        """Prove this host is the node (joining first with the one-time token
        when it has no identity yet); NodeRefused or ClusterUnavailable when
        it cannot. start() beats first once the relay listens."""
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
            node=identity.name,
            secret=identity.secret,
            ca=self._ca,
            plain_tcp=not settings.ROUNDHOUSE_CLUSTER_TLS,
            errors=self.errors,
        )
        self.peers = PeerLinks(
            LinkPool(
                node=identity.name,
                secret=identity.secret,
                ca=self._ca,
                plain_tcp=not settings.ROUNDHOUSE_CLUSTER_TLS,
            )
        )
        if self._ca is not None:
            self._tls_fingerprint = certificate_file_fingerprint(self._ca.cert)
        elif settings.ROUNDHOUSE_CLUSTER_TLS:
            *_, self._tls_fingerprint = relay_certificate(self.run_dir, self.name)
        self._bind = (settings.ROUNDHOUSE_RELAY_BIND or node.address, node.relay_port)
        self._records_digests = model_file_digests_writable()

    def start(self) -> None:
        """Start the relay (RelayStartError-free: a relay that cannot listen
        raises here) and the heartbeat."""
        relay_thread = threading.Thread(target=self._relay_main, name="relay")
        relay_thread.start()
        self._threads.append(relay_thread)
        self._relay_ready.wait(30)
        if self._relay_error is not None:
            raise self._relay_error
        # The first heartbeat only now: from it on the others link to this
        # node's relay, and a link failing counts against the node (a beat
        # before the relay listened made a slow start look unreachable).
        try:
            node_heartbeat(
                identity=self.identity,
                hardware=hardware_now(),
                version=software_version(),
                tls_fingerprint=self._tls_fingerprint,
            )
        except BaseException:
            self.stop()  # the relay's thread with it
            raise
        self._beat_ok = time.monotonic()
        beat_thread = threading.Thread(target=self._beat_main, name="heartbeat")
        beat_thread.start()
        self._threads.append(beat_thread)

    def stopped_loop(self) -> str | None:
        """The name of a loop thread (relay, heartbeat) that ended while the
        node was not stopping, or None."""
        if self._stopping.is_set():
            return None
        dead = [thread.name for thread in self._threads if not thread.is_alive()]
        return dead[0] if dead else None

    def stop(self) -> None:
        self._stopping.set()
        if self._loop is not None and self._relay is not None:
            with contextlib.suppress(RuntimeError, TimeoutError):  # loop ended
                if self.copies is not None:
                    self._loop.call_soon_threadsafe(self.copies.close)
                asyncio.run_coroutine_threadsafe(
                    self._close_peers(), self._loop
                ).result(5)
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
        # Any error of one beat is recorded (logged once, shown in the admin)
        # and the next beat comes as usual.
        next_beat = time.monotonic()
        while not self._stopping.is_set():
            with self.errors.guard("heartbeat"):
                snapshot = self.beat()
                if snapshot is not None:
                    self.follow(snapshot)
            next_beat = max(next_beat + BEAT_S, time.monotonic())
            self._stopping.wait(next_beat - time.monotonic())
        close_old_connections()

    def beat(self) -> Snapshot | None:
        """One heartbeat, and the cluster's view read back (None: no answer,
        or this node is revoked and stops). The database's outages are
        counted here; `follow` acts on the view."""
        if self.revoked.is_set():
            return None  # the supervisor is stopping
        if self._unavailable and self.peers is not None:
            # Back from an outage (this node may have been the one cut off):
            # its links' failures so far say nothing of its peers; they are
            # reported once a round has tried them again.
            self.peers.count_from_now()
        reaches = self.peers.reported() if self.peers is not None else None
        try:
            close_old_connections()
            node_heartbeat(
                identity=self.identity,
                hardware=hardware_now(),
                copies=self.copies.report(),
                loop_errors=self.errors.report(),
                reaches=reaches,
            )
            self._beat_ok = time.monotonic()
            snapshot = routing_snapshot(heartbeat_grace_s=self._outages.grace_s())
        except NodeRefused as refused:
            log.error("node %s: %s; stopping", self.name, refused.message)
            self.revoked.set()
            return None
        except UNAVAILABLE as error:
            if self._role_revoked(error):
                log.error(
                    "node %s is revoked (its database role may read nothing any "
                    "more); stopping",
                    self.name,
                )
                self.revoked.set()
                return None
            if not self._unavailable:
                log.error(
                    "node %s cannot reach the database (%s): the others take it "
                    "for unreachable after %g s, and its relay stops taking "
                    "streams then, unless its links say the database is down "
                    "for every node it reaches",
                    self.name,
                    str(error).strip() or type(error).__name__,
                    UNREACHABLE_AFTER_S,
                )
            self._unavailable = True
            self._outages.failed()
            return None  # the peers of the last view are still tried
        self._outages.worked()
        if self._unavailable:
            log.warning("node %s reaches the database again", self.name)
            self._unavailable = False
        return snapshot

    def follow(self, snapshot: Snapshot) -> None:
        """Act on the cluster's view: the peers to link to, revocations
        (another node's: drop its links), this node's placement, the model
        files to copy here, the digests to record and the model files the
        operator asked this node to delete (file_removals.py)."""
        if self.peers is not None:
            self.peers.want(*self._peers_of(snapshot))
        self._recheck_links(snapshot)
        self.placed = self._placed_here(snapshot)
        self._copy_missing(snapshot)
        self._record_digests()
        with self.errors.guard("file removals"):
            files_removals_follow(node_name=self.name)

    async def _close_peers(self) -> None:
        """End the rounds of the peer links (waited for: no task is left
        pending when the loop closes) and close their links."""
        if self._peer_rounds is not None:
            self._peer_rounds.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._peer_rounds
        if self.peers is not None:
            self.peers.close()

    def _role_revoked(self, error: BaseException) -> bool:
        """Whether `error` is the database refusing this node's own role
        everything (revoking a node takes every table from its role, open
        sessions too: its heartbeat then fails for lack of privilege, not
        with NodeRefused). A role that may still read its node's row lacks
        one privilege only (an upgrade's new column not granted yet): that
        is an error to show, not a revocation."""
        if not _permission_denied(error):
            return False
        try:
            node_row_readable(self.name)
        except UNAVAILABLE as again:
            return _permission_denied(again)
        return False

    def _peers_of(self, snapshot) -> tuple[list[Peer], set[str]]:
        """The other nodes to link to (every node beating lately, to learn
        when one is reachable again), and those of them serving now."""
        peers = [
            node
            for node in snapshot.nodes.values()
            if node.name != self.name
            and node.host
            and node.status not in ("pending", "revoked")
        ]
        return (
            [node_peer(node) for node in peers],
            {node.name for node in peers if node.serving},
        )

    async def _reckoned(self, reckoning: Reckoning) -> None:
        """A round of the peer links is over (on the relay's loop): what it
        found, for serving() and, in the run dir, for this host's fronts."""
        reached = reckoning.peers_reached()
        await asyncio.to_thread(peers_reached_write, self.run_dir, reached)
        self._reached = reached

    def _recheck_links(self, snapshot) -> None:
        """Remember every node's proof (callers are checked against them while
        the database is down), and close the relay's links of nodes that are
        no longer the ones that opened them: revoked, deleted, or joined again
        with a new secret."""
        if self._loop is None or self._relay is None:
            return
        linked = self._relay.linked_nodes()
        try:
            proofs = node_link_proofs(set(snapshot.nodes) | linked)
        except UNAVAILABLE:
            return  # checked again at the next beat
        self._known_proofs = proofs
        if linked:
            still = {name: proofs[name] for name in linked & set(proofs)}
            self._loop.call_soon_threadsafe(self._relay.recheck, still)

    def _placed_here(self, snapshot) -> dict[str, frozenset[str]]:
        """Engine of this node -> the models placed on it."""
        placed: dict[str, set[str]] = {}
        for model in snapshot.models:
            for engine in snapshot.placed(model):
                if snapshot.engines[engine].node == self.name:
                    placed.setdefault(engine, set()).add(model)
        return {engine: frozenset(models) for engine, models in placed.items()}

    def _copy_missing(self, snapshot) -> None:
        """Start copying the files of models placed here that this host lacks,
        from the serving nodes, those holding the model resident first."""
        placed = set().union(*self.placed.values()) if self.placed else set()
        try:
            paths, problems = model_paths_checked(placed)
        except UNAVAILABLE:
            return
        # A model whose path cannot be used here fails alone, shown as such.
        if problems:
            listed = "; ".join(f"{name}: {why}" for name, why in problems.items())
            self.errors.failed("model paths", ModelPathError(listed))
        else:
            self.errors.cleared("model paths")
        wanted = {}
        for model, path in paths.items():
            try:
                if not path.exists():
                    wanted[model] = path
            except OSError as error:  # that model fails alone
                self.errors.failed(f"copies of {model}", error)
        peers = {
            model: list(map(node_peer, copy_sources(snapshot, model, self.name)))
            for model in wanted
        }
        if self._loop is not None:
            digests = model_file_digests(set(wanted))
            self.copies.want(wanted, peers, self._loop, digests)

    def _record_digests(self) -> None:
        """On a host whose credentials may (a front's): hash the files of the
        models whose digests the catalog lacks and that this host has, off the
        heartbeat (on the relay's loop, in a thread), and record them once."""
        if not self._records_digests or self._loop is None:
            return
        try:
            unknown = models_without_digests()
        except UNAVAILABLE:
            return
        for model, path in unknown.items():
            if model in self._hashing:
                continue
            try:
                if not path.exists():
                    continue
            except OSError:
                continue
            self._hashing.add(model)
            asyncio.run_coroutine_threadsafe(
                self._hash_and_record(model, path), self._loop
            )

    async def _hash_and_record(self, model: str, path: Path) -> None:
        def record(digests: dict[str, str]) -> None:
            close_old_connections()
            if model_file_digests_record(name=model, digests=digests):
                log.info("recorded the SHA-256 of model %s's files", model)

        try:
            digests = await asyncio.to_thread(model_digests, path)
            await asyncio.get_running_loop().run_in_executor(self._db, record, digests)
        except UNAVAILABLE:
            self._hashing.discard(model)  # tried again once the database is back
        except Exception as error:  # noqa: BLE001 - that model alone
            # Not hashed again by this process: the error stays shown.
            self.errors.failed(f"digests of {model}", error)

    def _reaches_database(self) -> bool:
        """What the relay's PONGs say: this node's last heartbeat succeeded
        under DATABASE_FRESH_S ago."""
        return (
            not self._unavailable
            and time.monotonic() - self._beat_ok < DATABASE_FRESH_S
        )

    def serving(self) -> str | None:
        """Why the relay takes no streams now, or None."""
        if self.revoked.is_set():
            return f"node {self.name} is revoked"
        silent = time.monotonic() - self._beat_ok
        reached = self._reached
        if silent > UNREACHABLE_AFTER_S and not (
            reached is not None and reached.fresh() and reached.everyone_cut_off()
        ):
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
        # An error no task of the relay handled is recorded, not fatal.
        loop.set_exception_handler(self._relay_exception)
        self._relay = NodeRelay(
            node=self.name,
            authenticate=self._authenticate,
            engine_address=self._engine_address,
            serving=self.serving,
            database=self._reaches_database,
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
        if self.peers is not None:
            self._peer_rounds = loop.create_task(
                self.peers.run(PEER_ROUND_S, self._reckoned, self.errors)
            )
        try:
            loop.run_forever()
        except Exception as error:  # noqa: BLE001 - the thread ends: noticed
            self.errors.failed("relay", error)
        finally:
            loop.close()

    def _relay_exception(self, loop, context: dict) -> None:
        error = context.get("exception") or RuntimeError(context.get("message"))
        self.errors.failed("relay", error)

    async def _authenticate(self, node: str, secret: str) -> str | None:
        def check() -> str | None:
            close_old_connections()
            try:
                node_authenticate(name=node, secret=secret)
            except NodeRefused as refused:  # logged by the relay, rate-limited
                return refused.message
            return None

        def known() -> str | None:
            # The database is down: a node known by this secret at the last
            # heartbeat that read them is let in (revocations since then are
            # seen once the database is back: its links are closed then).
            proof = self._known_proofs.get(node)
            if proof is not None and hmac.compare_digest(proof, link_proof(secret)):
                return None
            return f"node {self.name} cannot check callers now (database unavailable)"

        if self._unavailable:  # no hello waits for a database that hangs
            return known()
        loop = asyncio.get_running_loop()
        try:
            why = await loop.run_in_executor(self._db, check)
        except UNAVAILABLE:
            return known()
        if why is None:
            self._known_proofs = {**self._known_proofs, node: link_proof(secret)}
        return why

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
