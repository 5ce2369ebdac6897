"""The front's view of the fleet (Gateway.snapshot) when the database stops
answering: one load in flight at a time, shared by every request that needs
one; a node of a cluster refuses from memory, without waiting for a load, once
its view is UNREACHABLE_AFTER_S old and the database failed it, whether the
failed load was a request's or a background refresh's; one host alone keeps
serving on its last view. /healthz answers from a view under a second old,
or, while the database does not answer, from the last one with its age.

The database is a loader the test controls (it answers, fails, or hangs until
released), and the view's age is a clock the test sets: no test sleeps."""

import asyncio
import threading
import time
import types

import pytest
from django import db
from django.test import Client

from api import gateway as gateway_module
from api import health as health_module
from api.errors import ApiCode, ApiError
from api.gateway import Gateway, front_gateway
from cluster.models import UNREACHABLE_AFTER_S
from cluster.peers_reached import MAX_AGE_S as PEERS_MAX_AGE_S
from cluster.peers_reached import PeersReached, peers_reached_write
from routing.placement import NodeRoute
from routing.select import EngineStatus, Snapshot
from tests.waiting import await_for, suspended_in


def fleet(*, cluster: bool, up: bool = True) -> Snapshot:
    """One engine; on a cluster, on node "a" (this host) of two."""
    node = "a" if cluster else ""
    nodes = {}
    if cluster:
        nodes = {name: NodeRoute(name, "ready") for name in ("a", "b")}
    engine = EngineStatus("e1", "cpu", frozenset(), up, node=node)
    return Snapshot(engines={"e1": engine}, models={}, nodes=nodes)


class Database:
    """The loader behind the gateway's cache: answers `answer` (a snapshot or
    an error to raise), after `released` is set (a database that hangs while
    it is clear). `loading` is set when a load has begun."""

    GUARD_S = 30.0  # a test that waits for a hung load fails, it does not hang

    def __init__(self, answer: Snapshot) -> None:
        self.answer: Snapshot | Exception = answer
        self.loads = 0
        self.loading = threading.Event()
        self.released = threading.Event()
        self.released.set()

    def load(self) -> Snapshot:
        self.loads += 1
        self.loading.set()
        self.released.wait(self.GUARD_S)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def hang(self, then: Snapshot | Exception) -> None:
        self.loading.clear()
        self.released.clear()
        self.answer = then

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def clock() -> types.SimpleNamespace:
    """The views' age: seconds the test sets."""
    return types.SimpleNamespace(now=0.0)


@pytest.fixture
def front(clock, monkeypatch):
    """A gateway over a Database; no pause between a failed load and the next
    (the test decides when loads happen), and a request that starts a reload
    after a failure hardly waits for it (the database hangs in these tests)."""
    monkeypatch.setattr(gateway_module, "RELOAD_AFTER_FAILURE_S", 0.0)
    monkeypatch.setattr(gateway_module, "RETRY_WAIT_S", 0.01, raising=False)
    made: list[tuple[Gateway, Database]] = []

    def make(first: Snapshot) -> tuple[Gateway, Database]:
        database = Database(first)
        gateway = Gateway(database.load, clock=lambda: clock.now)
        made.append((gateway, database))
        return gateway, database

    yield make
    for gateway, database in made:
        database.release()
        gateway.shutdown()


async def background_load_done(gateway: Gateway) -> None:
    """Wait for the load in flight (started by refresh_later, say) to end:
    the loader is one thread, which runs what it is given in order."""
    await asyncio.to_thread(gateway.in_loader_thread, lambda: None)


async def in_flight(database: Database) -> None:
    """Wait for a load of the (hanging) database to have begun."""
    assert await asyncio.to_thread(database.loading.wait, Database.GUARD_S)


def unconfirmed(error: ApiError) -> bool:
    return error.status == 503 and error.code == ApiCode.CLUSTER_UNCONFIRMED


async def test_requests_that_need_a_load_share_the_one_in_flight(front):
    """Eight requests find no view in memory while the database hangs, then
    fails: they wait for one load and all get its error. The control (the old
    gateway): each queued a load of its own on the loader thread, one after
    the other, and the last waited for all of them (the 9-10 s refusals)."""
    gateway, database = front(fleet(cluster=True))
    database.hang(then=db.OperationalError("connection timed out"))
    requests = [asyncio.ensure_future(gateway.snapshot()) for _ in range(8)]
    await in_flight(database)
    await await_for(
        lambda: all("finished" in suspended_in(request) for request in requests),
        what="every request waiting for the load",
    )
    database.release()
    outcomes = await asyncio.gather(*requests, return_exceptions=True)
    assert all(isinstance(outcome, db.OperationalError) for outcome in outcomes)
    assert database.loads == 1


async def test_a_failed_background_refresh_starts_the_clock(front, clock):
    """The cut-off node under traffic: requests answer from a view under
    UNREACHABLE_AFTER_S old while the refresh that each starts fails in the
    background. Past that age they are refused at once (503
    cluster_unconfirmed), from memory, while one reload hangs on the database
    in the background; once a reload succeeds, the node serves again. The
    control (the old gateway): background failures never counted, and the
    same requests were served from a view 7 s old."""
    gateway, database = front(fleet(cluster=True))
    assert await gateway.snapshot() is database.answer
    database.answer = db.OperationalError("connection timed out")
    clock.now = 2.0
    assert (await gateway.snapshot()).nodes  # a stale view, still confirmed
    gateway.refresh_later()  # the request reached its engine
    await background_load_done(gateway)
    assert database.loads == 2

    clock.now = UNREACHABLE_AFTER_S + 1
    back = fleet(cluster=True)
    database.hang(then=back)
    for _ in range(5):
        with pytest.raises(ApiError) as refused:
            await gateway.snapshot()
        assert unconfirmed(refused.value), refused.value
    await in_flight(database)
    assert database.loads == 3  # one reload in flight for all five

    database.release()
    await background_load_done(gateway)
    assert await gateway.snapshot() is back


async def test_a_database_back_is_read_by_the_next_request(front, clock, monkeypatch):
    """Node b's front refused while cut off, then saw no request until it was
    reconnected (the cluster test's last step): the next request starts a
    reload, waits for it (RETRY_WAIT_S at most) and is served from the new
    view, not refused from the view the failure left. The control (answering
    from memory until a background reload succeeded): refused."""
    monkeypatch.setattr(gateway_module, "RETRY_WAIT_S", Database.GUARD_S, raising=False)
    gateway, database = front(fleet(cluster=True))
    await gateway.snapshot()
    database.answer = db.OperationalError("connection timed out")
    clock.now = UNREACHABLE_AFTER_S + 1
    with pytest.raises(ApiError) as refused:
        await gateway.snapshot()
    assert unconfirmed(refused.value), refused.value
    back = fleet(cluster=True)
    database.answer = back
    clock.now = 60.0
    assert await gateway.snapshot() is back


async def test_a_cluster_view_past_the_limit_is_confirmed_before_use(front, clock):
    """A node of a cluster whose view is older than UNREACHABLE_AFTER_S (its
    front saw no request for a while) reads the fleet again before it routes
    on it; one host alone routes on a view up to STALE_LIMIT_S old while the
    next loads. The control (the old gateway): the node routed on a view
    older than the cluster's limit, up to STALE_LIMIT_S."""
    assert UNREACHABLE_AFTER_S + 1 < gateway_module.STALE_LIMIT_S
    node, node_database = front(fleet(cluster=True))
    host, host_database = front(fleet(cluster=False))
    first_on_node = await node.snapshot()
    first_on_host = await host.snapshot()
    clock.now = UNREACHABLE_AFTER_S + 1
    node_database.answer = fleet(cluster=True, up=False)
    host_database.answer = fleet(cluster=False, up=False)
    assert await node.snapshot() is node_database.answer
    assert first_on_node is not node_database.answer
    assert await host.snapshot() is first_on_host
    assert host_database.loads == 1


async def test_a_database_down_for_every_node_is_served_through(
    front, clock, settings, tmp_path
):
    """The database down for every node: this host's supervisor reaches its
    peers and none of them reaches the database either (its peers file says
    so), so a view past UNREACHABLE_AFTER_S is served, not refused. Controls:
    a peer that reaches the database (this node alone is cut off), too few
    peers reached, and a peers file gone stale (no supervisor) are refused."""
    settings.RUN_DIR = tmp_path
    gateway, database = front(fleet(cluster=True))
    last = await gateway.snapshot()
    database.answer = db.OperationalError("connection timed out")
    clock.now = UNREACHABLE_AFTER_S + 1

    def supervisor_found(*, reached=2, database=0, age_s=0.0) -> None:
        found = PeersReached(
            at=time.monotonic() - age_s, peers=3, reached=reached, database=database
        )
        peers_reached_write(tmp_path, found)

    supervisor_found()
    assert await gateway.snapshot() is last
    for refused_when in (
        {"database": 1},
        {"reached": 1},
        {"age_s": PEERS_MAX_AGE_S + 1},
    ):
        supervisor_found(**refused_when)
        with pytest.raises(ApiError) as refused:
            await gateway.snapshot()
        assert unconfirmed(refused.value), refused_when
    supervisor_found()
    assert await gateway.snapshot() is last


async def test_one_host_serves_on_its_last_view_through_an_outage(front, clock):
    """One host alone, the database down for minutes: the first request past
    the stale limit waits for its load, which fails; it and every later
    request are served from the last view at once, while one reload at a time
    tries the database in the background."""
    gateway, database = front(fleet(cluster=False))
    last = await gateway.snapshot()
    clock.now = 300.0
    database.answer = db.OperationalError("connection refused")
    assert await gateway.snapshot() is last
    database.hang(then=db.OperationalError("connection timed out"))
    for _ in range(5):
        assert await gateway.snapshot() is last
    await in_flight(database)
    assert database.loads == 3  # the first, the failed one, one reload


# -- /healthz -----------------------------------------------------------------


@pytest.fixture
def health_database(clock, monkeypatch, own_gateway):
    """The Database behind GATEWAY, the gateway /healthz asks."""
    database = Database(fleet(cluster=True))
    own_gateway(database.load, clock=lambda: clock.now)
    monkeypatch.setattr(gateway_module, "RELOAD_AFTER_FAILURE_S", 0.0)
    yield database
    database.release()
    front_gateway().in_loader_thread(lambda: None)  # its loads are over


def health() -> dict:
    answer = Client().get("/healthz")
    assert answer.status_code == 200
    return answer.json()


def test_health_answers_from_a_view_under_a_second_old(health_database, clock):
    """A monitor polls /healthz: node a was revoked and its engine is down
    since the last poll, 1.5 s ago. The answer says so at once (it read the
    fleet again: its view is under a second old). The control (the old
    health): it answered from the last request's view, up to 10 s old, and
    showed the revoked node's engine ready."""
    body = health()
    assert body["engines"]["e1"]["ready"]
    assert body["nodes"] == {"a": "ready", "b": "ready"}
    revoked = fleet(cluster=True, up=False)
    revoked.nodes["a"] = NodeRoute("a", "revoked")
    health_database.answer = revoked
    clock.now = 1.5
    body = health()
    assert not body["engines"]["e1"]["ready"]
    assert not body["engines_ready"]
    assert body["nodes"] == {"a": "revoked", "b": "ready"}
    assert body["view_age_s"] == 0.0


def test_health_in_an_outage_answers_from_the_last_view_with_its_age(
    health_database, clock, monkeypatch
):
    """The database fails, then hangs: /healthz answers 200 from the last
    view and says how old it is (waiting at most HEALTH_WAIT_S for a hung
    database); past UNREACHABLE_AFTER_S a node of a cluster shows no engine
    (it cannot confirm any). Once the database answers again, so does the
    view. The control (the old health): no age to tell a monitor how stale
    the readiness it shows is."""
    monkeypatch.setattr(health_module, "HEALTH_WAIT_S", 0.01, raising=False)
    assert health()["engines_ready"]
    health_database.answer = db.OperationalError("connection refused")
    clock.now = 5.0
    body = health()
    assert (body["engines_ready"], body["view_age_s"]) == (True, 5.0)
    health_database.hang(then=fleet(cluster=True, up=False))
    clock.now = UNREACHABLE_AFTER_S + 1
    body = health()
    assert (body["engines"], body["engines_ready"]) == ({}, False)
    assert body["view_age_s"] == UNREACHABLE_AFTER_S + 1
    health_database.release()
    front_gateway().in_loader_thread(lambda: None)  # the hung load answered
    body = health()
    assert (body["engines_ready"], body["view_age_s"]) == (False, 0.0)
    assert "e1" in body["engines"]
