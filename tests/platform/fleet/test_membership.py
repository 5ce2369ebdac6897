"""A node through a database outage (fleet/membership.py): its relay takes
streams on a stale heartbeat only while its links say the outage is
everyone's, and checks callers against the proofs it last read while the
database cannot answer."""

import asyncio
import time

import pytest
from django.db import connections
from node_link.protocol import LINK_PING_S
from node_link.relay import link_proof

from cluster.models import UNREACHABLE_AFTER_S
from cluster.peers_reached import MAX_AGE_S, PeersReached
from fleet.membership import DATABASE_FRESH_S, PEER_ROUND_S, Membership
from tests.engines.conftest import free_port


@pytest.fixture
def membership(tmp_path):
    """A node's membership, never joined nor started (nothing beats)."""
    node = Membership(name="n1", run_dir=tmp_path)
    yield node
    node._db.submit(connections.close_all).result()
    node._db.shutdown()


def cut_off(*, database: int, age_s: float = 0.0) -> PeersReached:
    """Most peers (2 of 3) reached, `database` of them reaching it."""
    return PeersReached(
        at=time.monotonic() - age_s, peers=3, reached=2, database=database
    )


def test_a_stale_heartbeat_is_served_through_only_when_the_outage_is_everyones(
    membership,
):
    """No heartbeat written for longer than UNREACHABLE_AFTER_S: the relay
    refuses streams, unless the node's fresh reckoning says the database is
    down for every peer it reaches. Controls: with a fresh heartbeat it
    serves; a reckoning in which a peer reaches the database, or one too old,
    does not let it serve; a revoked node never does."""
    assert membership.serving() is None
    membership._beat_ok = time.monotonic() - (UNREACHABLE_AFTER_S + 1)
    assert "cannot confirm its place" in membership.serving()
    membership._reached = cut_off(database=0)
    assert membership.serving() is None
    membership._reached = cut_off(database=1)
    assert "cannot confirm its place" in membership.serving()
    membership._reached = cut_off(database=0, age_s=MAX_AGE_S + 1)
    assert "cannot confirm its place" in membership.serving()
    membership._reached = cut_off(database=0)
    membership.revoked.set()
    assert membership.serving() == "node n1 is revoked"


def test_peers_are_told_the_database_is_unreached_once_a_beat_is_overdue(
    membership,
):
    """A heartbeat stuck on a silent database (its timeouts take seconds) is
    not waited for: once the last successful beat is DATABASE_FRESH_S old the
    relay's PONGs say the database is not reached, so a peer in the same
    outage learns it is everyone's before its own front gives up on its view.
    Control: a beat that succeeded just now says it is reached."""
    membership._beat_ok = time.monotonic()
    assert membership._reaches_database()
    membership._beat_ok = time.monotonic() - (DATABASE_FRESH_S + 0.1)
    assert not membership._reaches_database()
    assert DATABASE_FRESH_S + PEER_ROUND_S + LINK_PING_S < UNREACHABLE_AFTER_S


def database_unreachable() -> None:
    """In the calling thread (the relay's database thread), the database is
    out of reach from now on: its connection goes to a port or file that is
    not there."""
    connection = connections["default"]
    connection.close()
    if connection.vendor == "sqlite":
        gone = {"NAME": "/nonexistent/roundhouse/db.sqlite3"}
    else:
        gone = {"HOST": "127.0.0.1", "PORT": str(free_port())}
    connection.settings_dict = {**connection.settings_dict, **gone}


@pytest.mark.django_db
async def test_callers_are_checked_against_the_last_known_proofs_in_an_outage(
    membership,
):
    """While the database cannot answer, a node known by this secret at the
    last read is let in; a wrong secret or an unknown node is refused.
    Control: while the database answers, the same remembered proof lets
    nobody in that the database does not know (b has no row)."""
    membership._known_proofs = {"b": link_proof("b-secret")}
    refused = await membership._authenticate("b", "b-secret")
    assert refused is not None and "has not joined" in refused
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(membership._db, database_unreachable)
    assert await membership._authenticate("b", "b-secret") is None
    for node, secret in (("b", "a-guess"), ("c", "b-secret")):
        refused = await membership._authenticate(node, secret)
        assert refused is not None and "database unavailable" in refused
