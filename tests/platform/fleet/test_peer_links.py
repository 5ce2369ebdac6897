"""A node's own links to its peers' relays (fleet/peer_links.py), against real
relays on loopback: what a round finds (linked, or failing since when), what
the relays' PONGs say of the database, and the reckoning a node's fronts read
through an outage."""

import contextlib

from node_link.client import LinkPool, Peer
from node_link.relay import NodeRelay

from cluster.peers_reached import PeersReached
from fleet.peer_links import PeerLinks, Reckoning
from tests.engines.conftest import free_port
from tests.waiting import await_for

SECRET = "peer-links-secret"


@contextlib.asynccontextmanager
async def relay_of(node: str, *, port: int | None = None, database=lambda: True):
    """Node `node`'s relay on loopback, which welcomes node "a" by SECRET
    (no engines: a round only links and pings); its port."""

    async def authenticate(caller: str, secret: str) -> str | None:
        return None if (caller, secret) == ("a", SECRET) else "wrong secret"

    relay = NodeRelay(
        node=node,
        authenticate=authenticate,
        engine_address=lambda name: None,
        database=database,
    )
    port = port or free_port()
    await relay.start("127.0.0.1", port)
    try:
        yield port
    finally:
        await relay.close()


async def a_round(links: PeerLinks, peers: list[Peer], counted: set[str]) -> Reckoning:
    """One round of `links` over `peers`, to its end: its reckoning."""
    return await links.round(tuple(peers), frozenset(counted))


async def rounds_until(links, peers, counted, state, *, what: str) -> Reckoning:
    """Rounds until one's reckoning is in `state` (a PONG to come, a
    connection cooldown to pass); that reckoning."""

    async def once() -> Reckoning | None:
        reckoning = await a_round(links, peers, counted)
        return reckoning if state(reckoning) else None

    return await await_for(once, timeout=30, what=what)


async def test_a_round_finds_listening_relays_linked_and_a_closed_port_failing():
    """A round links to the relays of b and c (failing 0) and fails to
    reach d, whose port nobody listens on (failing for more than 0 s);
    once c's PONG says its node does not reach the database, c is no longer
    counted as reaching it (before its first PONG, unknown: taken for
    reaching). The reckoning: 3 peers, 2 reached, 1 with the database, not
    everyone's outage. Control: when b's node loses the database too, the
    same links make it everyone's; and once a relay listens on d's port, d
    is linked."""
    b_reaches = {"database": True}
    closed = free_port()
    async with (
        relay_of("b", database=lambda: b_reaches["database"]) as b_port,
        relay_of("c", database=lambda: False) as c_port,
    ):
        peers = [
            Peer(node="b", host="127.0.0.1", port=b_port),
            Peer(node="c", host="127.0.0.1", port=c_port),
            Peer(node="d", host="127.0.0.1", port=closed),
        ]
        counted = {"b", "c", "d"}
        links = PeerLinks(LinkPool(node="a", secret=SECRET, plain_tcp=True))
        try:
            first = await a_round(links, peers, counted)
            assert first.failing_s["b"] == 0 and first.failing_s["c"] == 0
            assert first.failing_s["d"] > 0
            assert "d" not in first.database
            reckoning = await rounds_until(
                links,
                peers,
                counted,
                lambda r: "c" not in r.database,
                what="c's PONG: its node does not reach the database",
            )
            assert reckoning.database == {"b"}
            assert reckoning.failing_s["d"] >= first.failing_s["d"]
            reached = reckoning.peers_reached()
            assert (reached.peers, reached.reached, reached.database) == (3, 2, 1)
            assert reached.fresh() and not reached.everyone_cut_off()
            # Control: b's node loses the database too.
            b_reaches["database"] = False
            reckoning = await rounds_until(
                links,
                peers,
                counted,
                lambda r: not r.database,
                what="b's PONG: its node does not reach the database",
            )
            reached = reckoning.peers_reached()
            assert (reached.peers, reached.reached, reached.database) == (3, 2, 0)
            assert reached.everyone_cut_off()
            # Control: a relay listens on d's port now.
            async with relay_of("d", port=closed):
                reckoning = await rounds_until(
                    links,
                    peers,
                    counted,
                    lambda r: r.failing_s.get("d") == 0,
                    what="d linked",
                )
            assert reckoning.peers_reached().reached == 3
        finally:
            links.close()


async def test_a_relay_that_is_not_the_peer_is_not_a_link():
    """A relay that answers as another node (the peer's address taken by
    someone else) is failing, like a closed port. Control: the same relay
    under its own name is linked."""
    async with relay_of("x") as port:
        links = PeerLinks(LinkPool(node="a", secret=SECRET, plain_tcp=True))
        try:
            impostor = [Peer(node="b", host="127.0.0.1", port=port)]
            assert (await a_round(links, impostor, {"b"})).failing_s["b"] > 0
            itself = [Peer(node="x", host="127.0.0.1", port=port)]
            assert (await a_round(links, itself, {"x"})).failing_s == {"x": 0}
        finally:
            links.close()


async def test_a_node_back_under_its_name_is_failing_from_its_return():
    """Node c failed for a while, then left; a new node c (another address)
    joins: its failing time counts from its own first try, not from the old
    c's. Control: the old c, still wanted, keeps counting."""
    closed, other = free_port(), free_port()
    old = [Peer(node="c", host="127.0.0.1", port=closed)]
    links = PeerLinks(LinkPool(node="a", secret=SECRET, plain_tcp=True))
    try:
        first = (await a_round(links, old, {"c"})).failing_s["c"]
        later = await rounds_until(
            links,
            old,
            {"c"},
            lambda r: r.failing_s["c"] > first + 0.2,
            what="the old c failing longer",
        )
        new = [Peer(node="c", host="127.0.0.2", port=other)]
        again = (await a_round(links, new, {"c"})).failing_s["c"]
        assert 0 < again < later.failing_s["c"], (again, later.failing_s)
    finally:
        links.close()


async def test_links_failing_count_from_the_node_reaching_the_database_again():
    """A node that was cut off itself failed to link to every peer meanwhile:
    once it reaches the database again (count_from_now), a peer it still
    cannot link to is failing since then, not since the cut. Control: without
    it, the same peer keeps counting from its first try."""
    closed = free_port()
    peers = [Peer(node="c", host="127.0.0.1", port=closed)]
    links = PeerLinks(LinkPool(node="a", secret=SECRET, plain_tcp=True))
    try:
        first = (await a_round(links, peers, {"c"})).failing_s["c"]
        cut = await rounds_until(
            links,
            peers,
            {"c"},
            lambda r: r.failing_s["c"] > first + 0.5,
            what="c failing a while (the cut)",
        )
        links.reckoning = cut
        assert links.reported() == cut.failing_s
        links.count_from_now()
        # The last round began before: nothing is reported until the next.
        assert links.reported() == {}
        links.reckoning = await a_round(links, peers, {"c"})
        back = links.reported()["c"]
        assert 0 < back < cut.failing_s["c"] - 0.4, (back, cut.failing_s)
        # Control: another node's links, never told, count from the first try.
        other = PeerLinks(LinkPool(node="a", secret=SECRET, plain_tcp=True))
        try:
            start = (await a_round(other, peers, {"c"})).failing_s["c"]
            later = await rounds_until(
                other,
                peers,
                {"c"},
                lambda r: r.failing_s["c"] > start + 0.5,
                what="c failing longer without count_from_now",
            )
            assert later.failing_s["c"] > start + 0.5
        finally:
            other.close()
    finally:
        links.close()


def test_only_the_counted_peers_linked_now_make_the_reckoning():
    """peers_reached counts the peers that were serving (`counted`), those
    of them linked now, and those of these whose relay reaches the database:
    a linked peer that does not count, and a database answer of a peer not
    linked now, are left out. Control: counting e too adds it."""
    reckoning = Reckoning(
        failing_s={"b": 0, "c": 0, "d": 3.2, "e": 0},
        database=frozenset({"b", "d", "e"}),
        counted=frozenset({"b", "c", "d"}),
    )
    reached = reckoning.peers_reached()
    assert isinstance(reached, PeersReached) and reached.fresh()
    assert (reached.peers, reached.reached, reached.database) == (3, 2, 1)
    counted_too = Reckoning(
        failing_s=reckoning.failing_s,
        database=reckoning.database,
        counted=frozenset({"b", "c", "d", "e"}),
    ).peers_reached()
    assert (counted_too.peers, counted_too.reached, counted_too.database) == (4, 3, 2)
    assert Reckoning().peers_reached().everyone_cut_off()  # no peers: nobody says
