"""A node's status from what the other nodes' links say of it
(cluster/selectors.py: nodes_now, unlinked): a node that every other credible
beating node fails to link to is unreachable after UNREACHABLE_AFTER_S, then
down, whatever its own heartbeat; a reporter counts only when its own network
evidently works; what a node writes in its `reaches` is read defensively; and
heartbeats missed while the reader saw the database down are forgiven."""

import math
from datetime import timedelta

import pytest
from django.utils import timezone

from cluster.models import UNREACHABLE_AFTER_S, Node, NodeStatus
from cluster.selectors import _seconds_failing, nodes_now, unlinked

pytestmark = pytest.mark.django_db

GRACE_S = 30.0
FAILING_S = UNREACHABLE_AFTER_S + 1  # 7 s: past the unreachable bound


def beating(name: str, reaches=None, *, age_s: float = 0.0) -> Node:
    """A joined node whose last heartbeat was `age_s` ago, reporting
    `reaches` (peer -> seconds its links failed, 0: linked)."""
    return Node.objects.create(
        name=name,
        address=f"10.0.7.{ord(name[0]) % 250}",
        secret_hash="0" * 64,
        joined_at=timezone.now(),
        last_heartbeat=timezone.now() - timedelta(seconds=age_s),
        reaches={} if reaches is None else reaches,
    )


def statuses(**kwargs) -> dict[str, NodeStatus]:
    return {name: view.status for name, view in nodes_now(**kwargs).items()}


def test_a_node_every_other_node_fails_to_link_to_is_unreachable_then_down():
    """a and b link to each other and both fail to link to c for 7 s: c is
    unreachable though its heartbeat is fresh; failing past 6 s + the grace
    period, c is down. c's own reports (it fails both) do not take a or b
    for unreachable: it links to nobody, so its word does not count. Control:
    with a linked to c, c is ready."""
    beating("a", {"b": 0, "c": FAILING_S})
    beating("b", {"a": 0, "c": FAILING_S})
    beating("c", {"a": FAILING_S, "b": FAILING_S})
    assert statuses(grace_s=GRACE_S) == {
        "a": NodeStatus.READY,
        "b": NodeStatus.READY,
        "c": NodeStatus.UNREACHABLE,
    }
    long_ago = UNREACHABLE_AFTER_S + GRACE_S + 1
    Node.objects.filter(name="a").update(reaches={"b": 0, "c": long_ago})
    Node.objects.filter(name="b").update(reaches={"a": 0, "c": long_ago})
    assert statuses(grace_s=GRACE_S)["c"] == NodeStatus.DOWN
    # Control: one node links to c, so not every other node fails to.
    Node.objects.filter(name="a").update(reaches={"b": 0, "c": 0})
    assert statuses(grace_s=GRACE_S)["c"] == NodeStatus.READY


def test_failing_links_under_the_bound_leave_a_node_ready():
    """Links failing for less than UNREACHABLE_AFTER_S (a link being remade)
    leave the node ready (control: the same reports past it, above)."""
    beating("a", {"b": 0, "c": UNREACHABLE_AFTER_S - 1})
    beating("b", {"a": 0, "c": UNREACHABLE_AFTER_S - 1})
    beating("c")
    assert statuses(grace_s=GRACE_S)["c"] == NodeStatus.READY
    Node.objects.filter(name="a").update(reaches={"b": 0, "c": FAILING_S})
    Node.objects.filter(name="b").update(reaches={"a": 0, "c": FAILING_S})
    assert statuses(grace_s=GRACE_S)["c"] == NodeStatus.UNREACHABLE


def test_of_two_nodes_that_cannot_link_either_way_neither_is_taken_for_cut_off():
    """a fails to link to b and b to a: neither reporter's network evidently
    works (neither links to anyone, nobody links to it), so both stay ready.
    Control: one way only (a fails b, b links to a): a's network works (b
    reaches it), so b, which a cannot reach, is unreachable."""
    beating("a", {"b": FAILING_S})
    beating("b", {"a": FAILING_S})
    assert statuses(grace_s=GRACE_S) == {"a": NodeStatus.READY, "b": NodeStatus.READY}
    Node.objects.filter(name="b").update(reaches={"a": 0})
    assert statuses(grace_s=GRACE_S) == {
        "a": NodeStatus.READY,
        "b": NodeStatus.UNREACHABLE,
    }


def test_only_nodes_beating_now_report():
    """b, which stopped beating (down), said it links to c; its word no
    longer counts, so a's report alone makes c unreachable. Control: with b
    beating, b's link to c keeps c ready."""
    beating("a", {"b": FAILING_S, "c": FAILING_S, "d": 0})
    beating("b", {"a": 0, "c": 0}, age_s=UNREACHABLE_AFTER_S + GRACE_S + 1)
    beating("c")
    beating("d", {"a": 0})
    now = statuses(grace_s=GRACE_S)
    assert now["b"] == NodeStatus.DOWN
    assert now["c"] == NodeStatus.UNREACHABLE
    Node.objects.filter(name="b").update(last_heartbeat=timezone.now())
    assert statuses(grace_s=GRACE_S)["c"] == NodeStatus.READY


GARBAGE = [
    pytest.param("7", id="a string"),
    pytest.param(-7, id="negative"),
    pytest.param(True, id="a bool"),
    pytest.param(None, id="null"),
    pytest.param([7], id="a list"),
    pytest.param({"s": 7}, id="an object"),
]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_in_reaches_is_ignored(garbage):
    """A node writes its own row: a value that is not a non-negative finite
    number of seconds is not a report (c stays ready, and nothing raises).
    Control: the same rows with 7 (a number) make c unreachable."""
    beating("a", {"b": 0, "c": garbage})
    beating("b", {"a": 0, "c": garbage})
    beating("c")
    assert statuses(grace_s=GRACE_S)["c"] == NodeStatus.READY
    Node.objects.filter(name="a").update(reaches={"b": 0, "c": FAILING_S})
    Node.objects.filter(name="b").update(reaches={"a": 0, "c": FAILING_S})
    assert statuses(grace_s=GRACE_S)["c"] == NodeStatus.UNREACHABLE


@pytest.mark.parametrize(
    "reaches",
    [
        pytest.param(["b", FAILING_S], id="a list"),
        pytest.param("b", id="a string"),
        pytest.param(FAILING_S, id="a number"),
    ],
)
def test_reaches_that_is_not_an_object_is_ignored(reaches):
    """`reaches` not an object: no report from that node, and nothing
    raises (b, linking to a, stays ready). Control: the object form of the
    same report makes b unreachable."""
    beating("a", reaches)
    beating("b", {"a": 0})
    assert statuses(grace_s=GRACE_S)["b"] == NodeStatus.READY
    Node.objects.filter(name="a").update(reaches={"b": FAILING_S})
    assert statuses(grace_s=GRACE_S)["b"] == NodeStatus.UNREACHABLE


def test_seconds_that_json_cannot_store_are_ignored_too():
    """NaN and infinities (what a database may refuse to store, but a row
    read some other way could hold) are not reports either; booleans are not
    numbers here. Control: a finite number is kept."""
    reports = {
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "true": True,
        "false": False,
        "negative": -0.5,
        "kept": 7,
        "linked": 0,
    }
    assert _seconds_failing(reports) == {"kept": 7.0, "linked": 0.0}
    rows = [
        Node(name="a", reaches={"b": 0, "c": math.nan}),
        Node(name="b", reaches={"a": 0, "c": math.inf}),
        Node(name="c", reaches={}),
    ]
    ready = dict.fromkeys("abc", NodeStatus.READY)
    assert unlinked(rows, ready) == {}
    rows[0].reaches["c"] = rows[1].reaches["c"] = FAILING_S
    assert unlinked(rows, ready) == {"c": FAILING_S}


def test_a_heartbeat_missed_in_an_outage_the_reader_saw_is_forgiven():
    """A heartbeat 10 s old: unreachable; read by one that saw the database
    down those 10 s (heartbeat_grace_s=10), ready. Control: no grace."""
    beating("a", age_s=10)
    assert statuses(grace_s=GRACE_S)["a"] == NodeStatus.UNREACHABLE
    assert statuses(grace_s=GRACE_S, heartbeat_grace_s=10)["a"] == NodeStatus.READY
    # A grace shorter than the silence past the bound forgives only part.
    assert statuses(grace_s=GRACE_S, heartbeat_grace_s=2)["a"] == NodeStatus.UNREACHABLE
