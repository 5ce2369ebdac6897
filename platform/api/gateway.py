"""How the front reaches engines: a routing snapshot at most a second old, the
router's choice, and a client: for an engine of this host, built from the
engine's connection file; for one of another node, over the link to that
node's relay (engines/wire/link_client.py), authenticated by this host's node
secret."""

import asyncio
import dataclasses
import logging
import os
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from django import db
from django.conf import settings

from cluster.identity import NodeIdentity, identity_read, identity_stamp
from cluster.models import UNREACHABLE_AFTER_S
from cluster.selectors import node_peer
from cluster.tls import private_ca
from engines.wire.client import AsyncEngineClient, EngineUnreachable, connection_file
from engines.wire.link_client import LinkPool, RemoteEngineClient
from fleet.selectors import HEARTBEAT_STALE_S, routing_snapshot
from routing.select import Choice, ModelRoute, Router, Snapshot, SnapshotCache

from . import errors
from .affinity import SharedAffinity
from .services import DATABASE_OUTAGE

log = logging.getLogger("roundhouse.api")

# A snapshot older than the cache's max age is still used while a fresh one loads
# in the background, up to this age; older than that, the request waits for the
# load (a front that saw no request for a while).
STALE_LIMIT_S = 10.0
# After a load failed on the database, the last snapshot (however old) is used
# and the next load waits this long: requests during an outage do not each try
# a database that is down.
RELOAD_AFTER_FAILURE_S = 1.0


def _log_failure(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("loading the routing snapshot failed: %s", done.exception())


class Gateway:
    """The front's one router and snapshot cache (shared by every request)."""

    def __init__(self) -> None:
        self.router = Router()
        self.cache = SnapshotCache(self._load, max_age_s=1.0)
        self._refreshing: asyncio.Future | None = None
        # Loads run in one thread of their own, which keeps its database
        # connection: asgiref's threads reconnect for every request.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._clients: dict[str, tuple[tuple, AsyncEngineClient]] = {}
        self._failed_at = -float("inf")  # loop.time() of the last failed load
        # The loader thread's view of database outages (time.monotonic()): when
        # the current one began, and the last one's (start, end).
        self._outage_began: float | None = None
        self.last_outage: tuple[float, float] | None = None
        # Cluster: this host's identity (read from the run dir, and again
        # when the file changed: looked at every IDENTITY_RECHECK_S), one link
        # pool per event loop, prompt-cache affinity and this front's requests
        # in flight per engine.
        self._identity: NodeIdentity | None = None
        self._identity_stamp: tuple[int, int] | None = None
        self._identity_checked = -float("inf")
        self._pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # The links' private CA, if the settings name one (read at start:
        # a misconfigured CA stops the front there, not at its first link).
        self.private_ca = private_ca()
        self.affinity = SharedAffinity(settings.REDIS_URL)
        self.in_flight: Counter[str] = Counter()

    def close(self) -> None:
        """Close the loader thread's database connection (it reconnects when
        needed)."""
        self._loader.submit(db.connections.close_all).result()

    def _load(self) -> Snapshot:
        """Read the fleet (in the loader thread). Heartbeats the supervisor could
        not write during an outage this thread saw end lately are not taken for
        a dead supervisor: staleness is counted without the outage."""
        try:
            snapshot = routing_snapshot(heartbeat_grace_s=self._heartbeat_grace())
        except db.DatabaseError:
            db.connection.close()  # a broken connection: the next load reconnects
            if self._outage_began is None:
                self._outage_began = time.monotonic()
            raise
        if self._outage_began is not None:
            self.last_outage = (self._outage_began, time.monotonic())
            self._outage_began = None
        return snapshot

    def _heartbeat_grace(self) -> float:
        """How long the database has been down (the outage this thread sees
        now, or the last one while it is recent enough to explain stale
        heartbeats); else 0."""
        now = time.monotonic()
        if self._outage_began is not None:
            return now - self._outage_began
        if self.last_outage is None:
            return 0.0
        began, ended = self.last_outage
        return ended - began if now - ended <= HEARTBEAT_STALE_S else 0.0

    async def _get(self) -> Snapshot:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._loader, self.cache.get)

    async def snapshot(self, *, fresh: bool = False) -> Snapshot:
        """The fleet as of about a second ago, read from the database at most
        once a second and, while requests keep coming, never on a request's
        path: a stale snapshot (up to STALE_LIMIT_S old) is used, and
        `refresh_later` loads the next one once the request is under way.
        `fresh`: wait for a snapshot under a second old.

        While the database is down, the last snapshot is used however old it
        is (an engine it shows up but that is gone fails over as usual); with
        none in memory the database's error is raised."""
        current = self.cache.fresh()
        if current is not None:
            return current
        peeked = self.cache.peek()
        if peeked is not None and self._failed_recently():
            return self._confirmed(*peeked)
        if (
            fresh
            or peeked is None
            or peeked[1] > STALE_LIMIT_S
            or self.cache.invalidated  # an engine just failed: read again
        ):
            try:
                snapshot = await self._get()
            except db.DatabaseError as error:
                self._failed_at = asyncio.get_running_loop().time()
                if peeked is None:
                    raise
                DATABASE_OUTAGE.failed("reading the fleet", error)
                return self._confirmed(*peeked)
            DATABASE_OUTAGE.worked()  # an outage seen here ends here too
            return snapshot
        return peeked[0]

    def _confirmed(self, snapshot: Snapshot, age_s: float) -> Snapshot:
        """The last snapshot, read again from the database in vain. One host
        alone keeps serving on it however old it is; a node of a cluster does
        only while it can confirm that the engines it routes to are still
        placed and up (UNREACHABLE_AFTER_S: by then the other nodes take this
        one for unreachable and its work is theirs)."""
        if snapshot.nodes and age_s > UNREACHABLE_AFTER_S:
            raise errors.cluster_unconfirmed(
                f"This node has not reached the cluster's database for "
                f"{age_s:.0f} s: it cannot confirm where models are served, and "
                "serves none until it can. Try another node's address."
            )
        return snapshot

    def _failed_recently(self) -> bool:
        now = asyncio.get_running_loop().time()
        return now - self._failed_at < RELOAD_AFTER_FAILURE_S

    def refresh_later(self) -> None:
        """Load a fresh snapshot in the background if this one is stale (called
        once a request has reached its engine, not before)."""
        if self.cache.fresh() is not None:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._get())
            self._refreshing.add_done_callback(_log_failure)

    def choose(
        self,
        model: ModelRoute,
        snapshot: Snapshot,
        *,
        excluding: set[str],
        affinity: str = "",
    ) -> Choice:
        """The router's choice, with engines that just failed taken for down,
        the `affinity` engine (whose prompt cache holds the request's longest
        prefix: self.affinity) preferred and this front's requests in flight
        counted as load."""
        if excluding:
            engines = {
                name: dataclasses.replace(engine, up=False)
                if name in excluding
                else engine
                for name, engine in snapshot.engines.items()
            }
            snapshot = dataclasses.replace(snapshot, engines=engines)
        return self.router.choose(
            model, snapshot, affinity=affinity, in_flight=self.in_flight
        )

    # -- nodes ------------------------------------------------------------------

    IDENTITY_RECHECK_S = 5.0

    @property
    def identity(self) -> NodeIdentity | None:
        """This host's node identity (None on a one-host platform, or before
        this host's supervisor joined). A new identity (the node revoked and
        added again, its supervisor joined anew) is taken within
        IDENTITY_RECHECK_S, without a restart: a stat of the file each time."""
        now = time.monotonic()
        if now - self._identity_checked > self.IDENTITY_RECHECK_S:
            self._identity_checked = now
            stamp = identity_stamp(settings.RUN_DIR)
            if stamp != self._identity_stamp:
                self._identity_stamp = stamp
                self._identity = identity_read(settings.RUN_DIR)
        return self._identity

    def node_of(self, engine: str, snapshot: Snapshot) -> str:
        status = snapshot.engines.get(engine)
        return status.node if status is not None else ""

    def is_local(self, node: str) -> bool:
        """Whether an engine of `node` listens on this host's loopback."""
        identity = self.identity
        return not node or (identity is not None and identity.name == node)

    def client(
        self, engine: str, snapshot: Snapshot | None = None
    ) -> AsyncEngineClient:
        """A client for `engine`: on this host, from its connection file; on
        another node (as `snapshot` says), over the link to that node."""
        node = self.node_of(engine, snapshot) if snapshot is not None else ""
        if not self.is_local(node):
            return self._remote_client(engine, node, snapshot)
        return self._local_client(engine)

    def _remote_client(
        self, engine: str, node: str, snapshot: Snapshot
    ) -> AsyncEngineClient:
        identity = self.identity
        route = snapshot.nodes.get(node)
        if identity is None:
            raise EngineUnreachable(
                f"engine {engine} runs on node {node}, and this host has not "
                "joined the cluster (no node identity in its run dir)"
            )
        if route is None:
            raise EngineUnreachable(f"engine {engine}: node {node} is unknown")
        loop = asyncio.get_running_loop()
        speaks_for, pool = self._pools.get(loop, (None, None))
        if pool is None or speaks_for != identity:
            if pool is not None:
                pool.close()  # links made with the identity this host had
            pool = LinkPool(
                node=identity.name, secret=identity.secret, ca=self.private_ca
            )
            self._pools[loop] = (identity, pool)
        return RemoteEngineClient(name=engine, pool=pool, peer=node_peer(route))

    def _local_client(self, engine: str) -> AsyncEngineClient:
        """A client for a supervised engine (EngineUnreachable without its file).

        The connection file is read again only when it changed (the supervisor
        replaces it, a new inode, when the engine restarts): a stat per request
        instead of opening, reading and parsing it."""
        path = connection_file(settings.RUN_DIR, engine)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            self._clients.pop(engine, None)
            return AsyncEngineClient.for_engine(settings.RUN_DIR, engine)  # raises
        signature = (info.st_ino, info.st_mtime_ns, info.st_size)
        cached = self._clients.get(engine)
        if cached is None or cached[0] != signature:
            cached = signature, AsyncEngineClient.for_engine(settings.RUN_DIR, engine)
            self._clients[engine] = cached
        return cached[1]


GATEWAY = Gateway()
