"""What a node's supervisor last learnt from its links (cluster/peers_reached.py):
whether a database outage is everyone's, the file its fronts read it from (its
user's only, written whole), and that nothing but a fresh, well-formed file
lets a front serve through an outage."""

import json
import os
import time

import pytest

from cluster.peers_reached import (
    MAX_AGE_S,
    MAX_BYTES,
    PeersReached,
    peers_file,
    peers_reached_read,
    peers_reached_write,
    serving_through_outage,
)


def reached(*, peers: int, linked: int, database: int, age_s: float = 0.0):
    """A reckoning written `age_s` ago (by this host's monotonic clock)."""
    return PeersReached(
        at=time.monotonic() - age_s, peers=peers, reached=linked, database=database
    )


@pytest.mark.parametrize(
    ("peers", "linked", "database", "cut_off"),
    [
        (0, 0, 0, True),  # no peers: nobody could say the database is up
        (3, 2, 0, True),  # most reached, none reaches the database
        (3, 3, 0, True),
        (3, 2, 1, False),  # control: one reached peer confirms the database
        (3, 3, 3, False),
        (3, 1, 0, False),  # control: a minority reached (this node is cut off)
        (4, 2, 0, False),  # half is not most
        (4, 0, 0, False),
    ],
)
def test_the_outage_is_everyones_when_most_peers_are_reached_and_none_has_it(
    peers, linked, database, cut_off
):
    """everyone_cut_off: this node reaches most of its peers (or has none)
    and none it reaches says it reaches the database; a reached peer that
    does, or reaching only a minority, says the outage is this node's
    alone."""
    assert (
        reached(peers=peers, linked=linked, database=database).everyone_cut_off()
        is cut_off
    )


def test_the_file_is_its_users_only_and_reads_back(tmp_path):
    """Written mode 0600 and read back as written; written again over itself
    (each heartbeat) it holds the new reckoning. Control: a run dir with no
    file reads as None."""
    first = reached(peers=3, linked=2, database=0)
    peers_reached_write(tmp_path, first)
    assert (os.stat(peers_file(tmp_path)).st_mode & 0o777) == 0o600
    assert peers_reached_read(tmp_path) == first
    second = reached(peers=3, linked=3, database=1)
    peers_reached_write(tmp_path, second)
    assert peers_reached_read(tmp_path) == second
    assert (os.stat(peers_file(tmp_path)).st_mode & 0o777) == 0o600
    assert sorted(path.name for path in tmp_path.iterdir()) == ["peers.json"]
    assert peers_reached_read(tmp_path / "elsewhere") is None


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"not json", id="garbage"),
        pytest.param(b"\xff\xfe{", id="not utf-8"),
        pytest.param(b"[1, 2, 3]", id="a list"),
        pytest.param(b"null", id="null"),
        pytest.param(b"", id="empty"),
        # Under the size cap, but deeper than json.loads recurses.
        pytest.param(b"[" * (MAX_BYTES - 1), id="deeply nested"),
        pytest.param("unknown", id="an unknown key"),
        pytest.param("negative", id="a negative count"),
        pytest.param("missing", id="a missing field"),
        pytest.param("oversize", id="over MAX_BYTES"),
    ],
)
def test_anything_but_the_supervisors_file_reads_as_none(tmp_path, content):
    """A file that is not a reckoning (garbage, another shape, an unknown
    key, one too large to be it) reads as None: a front does not serve
    through an outage on it. Control: the well-formed reckoning each bad one
    is made from reads (and would let a front serve)."""
    good = reached(peers=3, linked=2, database=0).model_dump()
    shapes = {
        "unknown": json.dumps({**good, "serving": True}).encode(),
        "negative": json.dumps({**good, "database": -1}).encode(),
        "missing": json.dumps({k: v for k, v in good.items() if k != "at"}).encode(),
        # Valid JSON, padded with whitespace past the cap.
        "oversize": json.dumps(good).encode() + b" " * MAX_BYTES,
    }
    peers_file(tmp_path).write_bytes(json.dumps(good).encode())
    assert peers_reached_read(tmp_path) == PeersReached(**good)
    assert serving_through_outage(tmp_path)
    peers_file(tmp_path).write_bytes(shapes.get(content, content))
    assert peers_reached_read(tmp_path) is None
    assert not serving_through_outage(tmp_path)


def test_a_stale_or_future_reckoning_does_not_let_a_front_serve(tmp_path):
    """serving_through_outage needs the supervisor's word now: a reckoning
    older than MAX_AGE_S (the supervisor stopped, or its beat is stuck), or
    one stamped ahead of this host's clock, does not count. Control: the same
    reckoning written now does; and a fresh one that is not everyone's
    outage does not."""
    peers_reached_write(tmp_path, reached(peers=3, linked=2, database=0))
    assert serving_through_outage(tmp_path)
    stale = reached(peers=3, linked=2, database=0, age_s=MAX_AGE_S + 1)
    assert stale.everyone_cut_off() and not stale.fresh()
    peers_reached_write(tmp_path, stale)
    assert not serving_through_outage(tmp_path)
    ahead = reached(peers=3, linked=2, database=0, age_s=-60)
    peers_reached_write(tmp_path, ahead)
    assert not serving_through_outage(tmp_path)
    peers_reached_write(tmp_path, reached(peers=3, linked=2, database=1))
    assert not serving_through_outage(tmp_path)
