"""Reads of cluster data: the nodes as the fleet sees them now."""

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models.functions import Now
from node_link.client import Peer

from routing.placement import NodeRoute

from .models import ClusterSettings, Node, NodeStatus


@dataclass(frozen=True)
class NodeView:
    """One node at one moment: where to reach it and what it is now."""

    name: str
    address: str
    relay_port: int
    labels: frozenset[str]
    status: NodeStatus
    tls_fingerprint: str
    heartbeat_age_s: float | None
    hardware: dict
    version: str
    copying: frozenset[str] = frozenset()  # models whose files it is copying


# Nodes that write heartbeats and links now: what they say of the others'
# links counts.
LINKING = frozenset({NodeStatus.READY, NodeStatus.DRAINING})


def _view(node: Node, now: datetime, status: NodeStatus) -> NodeView:
    return NodeView(
        name=node.name,
        address=node.address,
        relay_port=node.relay_port,
        labels=frozenset(node.labels),
        status=status,
        tls_fingerprint=node.tls_fingerprint,
        heartbeat_age_s=(now - node.last_heartbeat).total_seconds()
        if node.last_heartbeat
        else None,
        hardware=dict(node.hardware),
        version=node.version,
        copying=frozenset(node.copies or {}),
    )


def nodes_now(
    *, grace_s: float | None = None, heartbeat_grace_s: float = 0.0
) -> dict[str, NodeView]:
    """Every node with its status by the database's clock (the clock its
    heartbeats are written with). `heartbeat_grace_s`: the reader saw the
    database down that long, so heartbeats are not counted missed for it
    (nobody could write them). A node that every other node failed to link
    to lately (`unlinked`) is unreachable, then down, as if it had stopped
    beating that long."""
    rows = list(Node.objects.annotate(db_now=Now()))
    if not rows:
        return {}
    if grace_s is None:
        grace_s = ClusterSettings.load().grace_s
    forgiven = timedelta(seconds=max(heartbeat_grace_s, 0.0))
    beating = {
        node.name: node.status_at(node.db_now - forgiven, grace_s=grace_s)
        for node in rows
    }
    apart = unlinked(rows, beating)
    views = {}
    for node in rows:
        status = beating[node.name]
        if node.name in apart and status in LINKING:
            status = node.status_at(
                node.db_now - forgiven, grace_s=grace_s, unlinked_s=apart[node.name]
            )
        views[node.name] = _view(node, node.db_now, status)
    return views


def unlinked(rows: list[Node], statuses: dict[str, NodeStatus]) -> dict[str, float]:
    """Node -> for how long every other node failed to link to its relay, as
    their last heartbeats said (`Node.reaches`). Only nodes beating now
    report, and a report counts only from a node whose own network evidently
    works: it links to a third node, or another node links to it (of two
    nodes that cannot link to each other either way, neither is taken for
    the one cut off)."""
    reports = {
        row.name: _seconds_failing(row.reaches)
        for row in rows
        if statuses[row.name] in LINKING
    }
    linked_to = {
        name
        for failing in reports.values()
        for name, seconds in failing.items()
        if seconds == 0
    }
    apart = {}
    for target in reports:
        heard = [
            failing[target]
            for reporter, failing in reports.items()
            if reporter != target
            and target in failing
            and (
                reporter in linked_to
                or any(s == 0 for name, s in failing.items() if name != target)
            )
        ]
        if heard and min(heard) > 0:
            apart[target] = min(heard)
    return apart


def _seconds_failing(reaches) -> dict[str, float]:
    """A node's `reaches`, keeping only what is well formed (a node writes
    its own row: nothing else in it is trusted)."""
    if not isinstance(reaches, dict):
        return {}
    return {
        str(name): float(seconds)
        for name, seconds in reaches.items()
        if isinstance(seconds, int | float)
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
        and seconds >= 0
    }


def node_status(*, node: Node) -> NodeStatus:
    """One node's status now (its links as the others see them included)."""
    view = nodes_now().get(node.name)
    return view.status if view is not None else NodeStatus.PENDING


def node_peer(route: NodeRoute) -> Peer:
    """A node as a link reaches it: its relay's address and pinned certificate."""
    return Peer(
        node=route.name,
        host=route.host,
        port=route.relay_port,
        tls_fingerprint=route.tls_fingerprint,
    )


def node_link_proofs(names: set[str]) -> dict[str, str]:
    """Of these nodes, those that may hold links now (joined, not revoked),
    each with the SHA-256 its secret is stored under (what a relay's link of
    that node was opened with: node_link.relay.link_proof)."""
    rows = Node.objects.filter(name__in=names, revoked_at__isnull=True).exclude(
        secret_hash=""
    )
    return dict(rows.values_list("name", "secret_hash"))


def node_row_readable(name: str) -> bool:
    """Whether the node's row can be read on this connection (a revoked
    node's own role reads nothing: the database's error is raised)."""
    return Node.objects.filter(name=name).exists()
