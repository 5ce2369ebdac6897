"""Writes of cluster data: creating a node and its one-time join token,
joining, heartbeats, drain and revocation."""

import hmac
import logging
import secrets
from datetime import timedelta

from django.db import DatabaseError, connection, transaction
from django.db.models.functions import Now
from django.utils import timezone

from .identity import NodeIdentity, secret_hash
from .models import ClusterSettings, Node

log = logging.getLogger("roundhouse.cluster")


class ClusterUnavailable(Exception):
    """Cluster mode cannot run on this database (SQLite: one node only)."""


class NodeRefused(Exception):
    """A join token or node secret that does not prove the node; `message`
    says why, fit to show an operator (never the secret)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def cluster_database_check() -> None:
    """ClusterUnavailable unless the database can be shared by several hosts."""
    if connection.vendor != "postgresql":
        raise ClusterUnavailable(
            "cluster mode needs PostgreSQL (set DATABASE_URL); on "
            f"{connection.vendor} the platform runs as one node"
        )


def node_join_token_issue(*, node: Node) -> str:
    """A new one-time join token for the node (the only time it is seen in
    the clear); any earlier token stops working. Its expiry is by the
    database's clock (the joining host's may differ from this one's)."""
    token = "rhj-" + secrets.token_urlsafe(32)
    ttl = ClusterSettings.load().join_token_ttl_s
    node.join_token_hash = secret_hash(token)
    node.join_token_expires_at = Now() + timedelta(seconds=ttl)
    node.save(update_fields=["join_token_hash", "join_token_expires_at", "updated_at"])
    node.refresh_from_db(fields=["join_token_expires_at"])
    return token


def node_create(
    *, name: str, address: str, relay_port: int = 8765, labels: list[str] | None = None
) -> tuple[Node, str]:
    """Add a node; the node and its one-time join token."""
    node = Node(name=name, address=address, relay_port=relay_port, labels=labels or [])
    node.full_clean()
    node.save()
    return node, node_join_token_issue(node=node)


def node_join(*, name: str, join_token: str) -> NodeIdentity:
    """Exchange a node's join token for its own secret: the token works once,
    before it expires, for a node that is not revoked."""
    cluster_database_check()
    with transaction.atomic():
        node = (
            Node.objects.select_for_update()
            .annotate(db_now=Now())
            .filter(name=name)
            .first()
        )
        if node is None:
            raise NodeRefused(f"no node named {name!r}: add it in the admin first")
        if node.revoked_at is not None:
            raise NodeRefused(f"node {name!r} is revoked")
        if not node.join_token_hash or not hmac.compare_digest(
            node.join_token_hash, secret_hash(join_token)
        ):
            raise NodeRefused(
                f"the join token of node {name!r} is wrong or was used already: "
                "show a new join command in the admin"
            )
        if node.join_token_expires_at and node.join_token_expires_at < node.db_now:
            raise NodeRefused(
                f"the join token of node {name!r} expired: show a new join command "
                "in the admin"
            )
        secret = "rhn-" + secrets.token_urlsafe(32)
        node.secret_hash = secret_hash(secret)
        node.join_token_hash = ""
        node.join_token_expires_at = None
        node.joined_at = timezone.now()
        # Only the join's columns: a node's own database role may write no
        # other (fleet/node_database.py).
        node.save(
            update_fields=[
                "secret_hash",
                "join_token_hash",
                "join_token_expires_at",
                "joined_at",
                "updated_at",
            ]
        )
    return NodeIdentity(name=name, secret=secret)


def node_authenticate(*, name: str, secret: str) -> Node:
    """The node this secret proves; NodeRefused for an unknown or revoked
    node or a wrong secret."""
    node = Node.objects.filter(name=name).first()
    if node is None or not node.secret_hash:
        raise NodeRefused(f"node {name!r} has not joined")
    if not hmac.compare_digest(node.secret_hash, secret_hash(secret)):
        raise NodeRefused(f"wrong secret for node {name!r}")
    if node.revoked_at is not None:
        raise NodeRefused(f"node {name!r} is revoked")
    return node


def node_heartbeat(
    *,
    identity: NodeIdentity,
    hardware: dict | None = None,
    version: str | None = None,
    tls_fingerprint: str | None = None,
    copies: dict | None = None,
    loop_errors: dict | None = None,
    reaches: dict | None = None,
) -> Node:
    """Record that the node is alive (the database's clock, so hosts whose
    clocks differ agree on its age), with what it reports of itself;
    NodeRefused once it is revoked or its secret no longer matches."""
    node = node_authenticate(name=identity.name, secret=identity.secret)
    fields = {"last_heartbeat": Now(), "updated_at": timezone.now()}
    if hardware is not None:
        fields["hardware"] = hardware
    if version is not None:
        fields["version"] = version
    if tls_fingerprint is not None:
        fields["tls_fingerprint"] = tls_fingerprint
    if copies is not None:
        fields["copies"] = copies
    if loop_errors is not None:
        fields["loop_errors"] = loop_errors
    if reaches is not None:
        fields["reaches"] = reaches
    Node.objects.filter(pk=node.pk, revoked_at__isnull=True).update(**fields)
    return node


def node_drain(*, node: Node, draining: bool = True) -> None:
    """Drain a node (no new requests; streams finish; its replicas are placed
    elsewhere), or take it back."""
    node.draining = draining
    node.save(update_fields=["draining", "updated_at"])


def node_revoke(*, node: Node) -> None:
    """Revoke a node: its secret and any join token stop working at once (the
    relays of the other nodes close its links), its supervisor stops, and its
    own database role (if it has one) loses every table, open sessions too."""
    node.revoked_at = timezone.now()
    node.join_token_hash = ""
    node.join_token_expires_at = None
    node.save(
        update_fields=[
            "revoked_at",
            "join_token_hash",
            "join_token_expires_at",
            "updated_at",
        ]
    )
    if node.db_role:
        _node_role_revoke(node.db_role)


def _node_role_revoke(role: str) -> None:
    """Take every table's privileges from a revoked node's role (the tables'
    owner, the front's user, granted them; revoked, they are gone for its
    open sessions as well). Its row-level policies already refuse a revoked
    node's writes: this also ends its reads."""
    if connection.vendor != "postgresql":
        return
    who = connection.ops.quote_name(role)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT current_schema()")
            schema = connection.ops.quote_name(cursor.fetchone()[0])
            cursor.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {who}")
    except DatabaseError as error:
        log.warning(
            "node role %s keeps its privileges (%s): drop it with "
            "`manage.py node_db_role NAME --drop`",
            role,
            str(error).strip(),
        )
