"""Reads of cluster data: the nodes as the fleet sees them now."""

from dataclasses import dataclass
from datetime import datetime

from django.db.models.functions import Now

from engines.wire.link_client import Peer
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


def _view(node: Node, now: datetime, grace_s: float) -> NodeView:
    return NodeView(
        name=node.name,
        address=node.address,
        relay_port=node.relay_port,
        labels=frozenset(node.labels),
        status=node.status_at(now, grace_s=grace_s),
        tls_fingerprint=node.tls_fingerprint,
        heartbeat_age_s=(now - node.last_heartbeat).total_seconds()
        if node.last_heartbeat
        else None,
        hardware=dict(node.hardware),
        version=node.version,
        copying=frozenset(node.copies or {}),
    )


def nodes_now(*, grace_s: float | None = None) -> dict[str, NodeView]:
    """Every node with its status by the database's clock (the clock its
    heartbeats are written with)."""
    rows = list(Node.objects.annotate(db_now=Now()))
    if not rows:
        return {}
    if grace_s is None:
        grace_s = ClusterSettings.load().grace_s
    return {node.name: _view(node, node.db_now, grace_s) for node in rows}


def node_status(*, node: Node) -> NodeStatus:
    """One node's status now."""
    now = Node.objects.annotate(db_now=Now()).values_list("db_now", flat=True)
    return node.status_at(now.get(pk=node.pk), grace_s=ClusterSettings.load().grace_s)


def node_peer(route: NodeRoute) -> Peer:
    """A node as a link reaches it: its relay's address and pinned certificate."""
    return Peer(
        node=route.name,
        host=route.host,
        port=route.relay_port,
        tls_fingerprint=route.tls_fingerprint,
    )
