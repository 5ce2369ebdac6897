"""How the front reaches engines: a routing snapshot at most a second old, the
router's choice, and a client: for an engine of this host, built from the
engine's connection file; for one of another node, over the link to that
node's relay (platform/node_link/client.py), authenticated by this host's node
secret."""

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from django import db
from django.conf import settings
from node_link.client import LinkPool, RemoteEngineClient

from cluster.identity import NodeIdentity, identity_read, identity_stamp
from cluster.models import UNREACHABLE_AFTER_S
from cluster.peers_reached import serving_through_outage
from cluster.selectors import node_peer
from cluster.tls import private_ca
from engines.wire.client import AsyncEngineClient, EngineUnreachable, connection_file
from fleet.outages import OutageClock
from fleet.selectors import routing_snapshot
from routing.select import (
    Choice,
    ModelRoute,
    NoEngine,
    Router,
    Snapshot,
    SnapshotCache,
)

from . import errors
from .affinity import SharedAffinity
from .parts import Part
from .services import DATABASE_OUTAGE

log = logging.getLogger("roundhouse.api")

T = TypeVar("T")

# A snapshot older than the cache's max age is still used while a fresh one loads
# in the background, up to this age (on a cluster, up to UNREACHABLE_AFTER_S);
# older than that, the request waits for the load in flight (a front that saw no
# request for a while).
STALE_LIMIT_S = 10.0
# After a load failed on the database, requests answer from the last snapshot
# without waiting (or refuse: Gateway._confirmed) until a load succeeds, and the
# next load starts this long after the failure at the earliest: requests during
# an outage do not each try a database that is down.
RELOAD_AFTER_FAILURE_S = 1.0
# A node no link could be made to is passed over by this front's routing for
# this long (its engines are chosen only when no other engine can serve);
# then the next request tries it again.
NODE_AVOID_S = 5.0
# After a failed load, the request that starts the next one waits this long for
# it at most: a database that is back answers within it (the request is served
# from the new view, not refused from the old); one that still hangs costs that
# one request no more, and the others do not wait for it at all.
RETRY_WAIT_S = 0.5
# A kept connection the server closed fails a query within this (the network
# timing out takes seconds: settings' tcp_user_timeout).
CLOSED_FAILS_WITHIN_S = 1.0


async def finished(work: Future, timeout: float | None = None) -> bool:
    """Wait, without blocking the event loop, until `work` (of another thread)
    is done or `timeout` passed; whether it is done. Unlike awaiting
    asyncio.wrap_future, giving up never cancels the work, which others may
    share."""
    if work.done():
        return True
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake(_: Future) -> None:
        with contextlib.suppress(RuntimeError):  # that loop has closed since
            loop.call_soon_threadsafe(done.set)

    work.add_done_callback(wake)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        return False
    return True


def unconfirmed(snapshot: Snapshot, age_s: float) -> bool:
    """Whether a node of a cluster can no longer vouch for this view: the
    other nodes take one that has not reached the database for
    UNREACHABLE_AFTER_S for unreachable, and its work is theirs, unless this
    host's supervisor finds the database down for every node it reaches
    (then nobody takes anything: it serves on, as one host does)."""
    return (
        bool(snapshot.nodes)
        and age_s > UNREACHABLE_AFTER_S
        and not serving_through_outage(settings.RUN_DIR)
    )


class Gateway:
    """The front's one router and snapshot cache (shared by every request).

    `load` reads the routing snapshot (by default `fleet_load`: the fleet's,
    from the database, in the loader thread) and `clock` times its age: a
    test's own gateway gives its own (api.parts: `gateway.installed`)."""

    def __init__(
        self,
        load: Callable[[], Snapshot] | None = None,
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = Router()
        self.cache = SnapshotCache(load or self.fleet_load, max_age_s, clock)
        # Loads run in one thread of their own, which keeps its database
        # connection: asgiref's threads reconnect for every request.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._clients: dict[str, tuple[tuple, AsyncEngineClient]] = {}
        # The one load in flight (shared by every caller that needs it), and
        # whether the last load failed on the database, when (time.monotonic()).
        self._loading: Future | None = None
        self._flight_lock = threading.Lock()
        self._failing = False
        self._failed_at = -float("inf")
        # The loader thread's view of database outages.
        self.outages = OutageClock()
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
        # Node -> when (time.monotonic()) a link to it last failed.
        self._unreachable_nodes: dict[str, float] = {}

    def in_loader_thread(self, work: Callable[[], T]) -> T:
        """Run `work` in the loader thread, after what is queued there (the
        loads in flight), and return its result: what touches the loader's
        own database connection or the snapshot cache runs there."""
        return self._loader.submit(work).result()

    def close(self) -> None:
        """Close the loader thread's database connection (it reconnects when
        needed)."""
        self.in_loader_thread(db.connections.close_all)

    def request_sent(self, engine: str) -> None:
        """This front sent `engine` a request: one more in flight there (the
        router's count of this front's load on it)."""
        self.in_flight[engine] += 1

    def request_ended(self, engine: str) -> None:
        """A request this front sent `engine` ended: one fewer in flight."""
        self.in_flight[engine] -= 1
        if self.in_flight[engine] <= 0:
            del self.in_flight[engine]

    def shutdown(self) -> None:
        """Stop the loader thread, once its loads are over (a gateway that
        is done with: a test's own)."""
        self._loader.shutdown(wait=True)

    def forget(self) -> None:
        """Forget what this front knows of the fleet (the snapshot, a failed
        load, nodes passed over), after the load in flight: the next request
        reads the database. For a test that starts from a new database."""
        self.in_loader_thread(self.cache.clear)
        self._failing = False
        self._failed_at = -float("inf")
        self._unreachable_nodes.clear()

    def fleet_load(self) -> Snapshot:
        """Read the fleet (in the loader thread): the default `load`, which a
        test's own may wrap. Heartbeats the supervisor could
        not write during an outage this thread saw end lately are not taken for
        a dead supervisor: staleness is counted without the outage. A kept
        connection the server closed is replaced at once, not taken for an
        outage."""
        # A connection this thread kept from an earlier load may have been
        # closed by the server meanwhile (a restart, an idle timeout, a
        # terminated session): that fails at once, and is tried once more on
        # a new connection before it counts as the database failing. One that
        # failed only after a while (the network's timeouts) is not: a retry
        # would wait as long again.
        reused = db.connection.connection is not None
        while True:
            started = time.monotonic()
            try:
                snapshot = routing_snapshot(heartbeat_grace_s=self.outages.grace_s())
            except db.DatabaseError:
                db.connection.close()  # a broken connection: the next try reconnects
                if reused and time.monotonic() - started < CLOSED_FAILS_WITHIN_S:
                    reused = False
                    continue
                self.outages.failed()
                raise
            self.outages.worked()
            return snapshot

    def _reload(self) -> Snapshot:
        """A load (in the loader thread) whose outcome counts wherever it was
        started from, a request waiting for it or a refresh in the background:
        after a failure requests answer from memory (`snapshot`) until a load
        succeeds."""
        try:
            snapshot = self.cache.get()
        except db.DatabaseError as error:
            self._failed_at = time.monotonic()
            self._failing = True
            DATABASE_OUTAGE.failed("reading the fleet", error)
            raise
        except BaseException:
            log.exception("loading the routing snapshot failed")
            raise
        self._failing = False
        DATABASE_OUTAGE.worked()  # an outage seen here ends here too
        return snapshot

    def _load_started(self) -> Future:
        """The load in flight, or a new one: every caller that needs a load
        shares the one in flight (a database that hangs holds one load, not
        one per request queued on the loader thread)."""
        with self._flight_lock:
            if self._loading is None or self._loading.done():
                self._loading = self._loader.submit(self._reload)
            return self._loading

    def _reload_started(self) -> Future | None:
        """A new load, unless one is in flight or the database failed the
        last under RELOAD_AFTER_FAILURE_S ago (then None)."""
        if self._reload_held_back():
            return None
        with self._flight_lock:
            if self._loading is not None and not self._loading.done():
                return None
            self._loading = self._loader.submit(self._reload)
            return self._loading

    async def _loaded(self) -> Snapshot:
        """The result of the load in flight (or of a new one)."""
        loading = self._load_started()
        await finished(loading)
        return loading.result()

    async def snapshot(self, *, fresh: bool = False) -> Snapshot:
        """The fleet as of about a second ago, read from the database at most
        once a second and, while requests keep coming, never on a request's
        path: a stale snapshot (up to STALE_LIMIT_S old, UNREACHABLE_AFTER_S
        on a cluster) is used, and `refresh_later` loads the next one once the
        request is under way. `fresh`: wait for a snapshot under a second old.

        Once a load failed on the database (on a request's path or in the
        background), requests answer from memory until a load succeeds: one
        host serves on the last snapshot however old it is (an engine it shows
        up but that is gone fails over as usual), a node of a cluster refuses
        once it is UNREACHABLE_AFTER_S old (`_confirmed`). One reload at a time
        tries the database; only the request that starts it waits for it, at
        most RETRY_WAIT_S. With none in memory the database's error is
        raised."""
        current = self.cache.fresh()
        if current is not None:
            return current
        peeked = self.cache.peek()
        if peeked is not None and self._failing:
            retry = self._reload_started()
            if retry is not None:
                await finished(retry, timeout=RETRY_WAIT_S)
                current = self.cache.fresh()
                if current is not None:
                    return current
            return self._confirmed(*self.cache.peek())
        if (
            fresh
            or peeked is None
            or peeked[1] > self._stale_limit(peeked[0])
            or self.cache.invalidated  # an engine just failed: read again
        ):
            try:
                return await self._loaded()
            except db.DatabaseError:
                peeked = self.cache.peek()
                if peeked is None:
                    raise
                return self._confirmed(*peeked)
        return peeked[0]

    async def view(self, *, wait_s: float) -> tuple[Snapshot, float] | None:
        """The fleet under a second old, with its age in seconds: waits up to
        `wait_s` for the load in flight (or a new one, unless the database
        failed one under RELOAD_AFTER_FAILURE_S ago); failing that, the last
        snapshot read, however old; None if none was ever read. For what must
        not lag the fleet (/healthz): it never refuses and never raises the
        database's error."""
        if self.cache.fresh() is None and not self._reload_held_back():
            await finished(self._load_started(), timeout=wait_s)
        return self.cache.peek()  # the load's, or the last one read

    @staticmethod
    def _stale_limit(snapshot: Snapshot) -> float:
        """How old a snapshot may be used while the next one loads: on a
        cluster, never past the age at which it is unconfirmed."""
        if snapshot.nodes:
            return min(STALE_LIMIT_S, UNREACHABLE_AFTER_S)
        return STALE_LIMIT_S

    def _confirmed(self, snapshot: Snapshot, age_s: float) -> Snapshot:
        """The last snapshot, read again from the database in vain. One host
        alone keeps serving on it however old it is; a node of a cluster does
        only while it can confirm that the engines it routes to are still
        placed and up (UNREACHABLE_AFTER_S: by then the other nodes take this
        one for unreachable and its work is theirs)."""
        if unconfirmed(snapshot, age_s):
            raise errors.cluster_unconfirmed(
                f"This node has not reached the cluster's database for "
                f"{age_s:.0f} s: it cannot confirm where models are served, and "
                "serves none until it can. Try another node's address."
            )
        return snapshot

    def _reload_held_back(self) -> bool:
        """Whether the database failed a load under RELOAD_AFTER_FAILURE_S ago
        (requests during an outage do not each try a database that is down)."""
        return (
            self._failing
            and time.monotonic() - self._failed_at < RELOAD_AFTER_FAILURE_S
        )

    def refresh_later(self) -> None:
        """Load a fresh snapshot in the background if this one is stale (called
        once a request has reached its engine, not before): one load at a
        time, and none under RELOAD_AFTER_FAILURE_S after the last one
        failed."""
        if self.cache.fresh() is None:
            self._reload_started()

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
        counted as load. Engines of a node this front could not link to lately
        (node_unreachable) are passed over while another can serve."""
        avoided = self._avoided_nodes()
        if avoided:
            passed_over = excluding | {
                name
                for name, engine in snapshot.engines.items()
                if engine.node in avoided
            }
            with contextlib.suppress(NoEngine):
                return self._choose(model, snapshot, passed_over, affinity)
        return self._choose(model, snapshot, excluding, affinity)

    def _choose(
        self, model: ModelRoute, snapshot: Snapshot, excluding: set[str], affinity: str
    ) -> Choice:
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

    def node_unreachable(self, node: str) -> None:
        """No link to `node` could be made: its engines are passed over for
        NODE_AVOID_S (this front's routing, at once)."""
        self._unreachable_nodes[node] = time.monotonic()

    def _avoided_nodes(self) -> set[str]:
        horizon = time.monotonic() - NODE_AVOID_S
        for node, failed_at in list(self._unreachable_nodes.items()):
            if failed_at < horizon:
                del self._unreachable_nodes[node]
        return set(self._unreachable_nodes)

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
                node=identity.name,
                secret=identity.secret,
                ca=self.private_ca,
                plain_tcp=not settings.ROUNDHOUSE_CLUSTER_TLS,
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


# The front's gateway (api.parts): built when the front starts, never at import.
front_gateway: Part[Gateway] = Part(Gateway)
