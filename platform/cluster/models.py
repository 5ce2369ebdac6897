"""Nodes: the hosts of a cluster. A node joins with a one-time token, then
proves itself with its own secret (both stored here only as SHA-256 hashes),
heartbeats through the database, and is drained or revoked from the admin.
Its status is derived from those facts when read (`Node.status_at`), never
written by one host about another: no coordinator decides who is down."""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from catalog.models import validate_labels

PORT_VALIDATORS = [MinValueValidator(1), MaxValueValidator(65535)]

# A node whose last heartbeat is older than this is unreachable: it heartbeats
# every 2 s, so three missed beats; readers refresh their view every second,
# which keeps the whole detection within 10 s.
UNREACHABLE_AFTER_S = 6.0


class NodeStatus(models.TextChoices):
    """What a node is now, derived from its row and the database's clock."""

    PENDING = "pending", "pending (not joined yet)"
    READY = "ready"
    DRAINING = "draining"
    UNREACHABLE = "unreachable"
    DOWN = "down"
    REVOKED = "revoked"


@dataclass(frozen=True)
class FileRemoval:
    """One model's file removal on a node (fleet/file_removals.py), as the
    front shows it: `state` is "pending" (asked, not answered yet), "done"
    (`freed` bytes) or "refused" (`refused`: why); `at`: when the node
    answered ("" while pending)."""

    model: str
    requested_at: str
    state: str
    freed: int = 0
    refused: str = ""
    at: str = ""


class Node(models.Model):
    """One host of the cluster: where its relay listens, what it has, how it
    proves itself, and the operator's orders (drain, revoke)."""

    name = models.SlugField(max_length=64, unique=True)
    address = models.CharField(
        max_length=255,
        help_text="Host name or IP address the other nodes reach this node's relay at.",
    )
    relay_port = models.PositiveIntegerField(
        default=8765,
        validators=PORT_VALIDATORS,
        help_text="The port of its node relay (the supervisor runs it).",
    )
    labels = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_labels],
        help_text='Labels models may require or avoid, e.g. ["gpu", "zone-a"].',
    )
    draining = models.BooleanField(
        default=False,
        editable=False,
        help_text="Drained: no new requests, streams finish, its replicas move.",
    )
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    join_token_hash = models.CharField(max_length=64, blank=True, editable=False)
    join_token_expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    secret_hash = models.CharField(max_length=64, blank=True, editable=False)
    joined_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_heartbeat = models.DateTimeField(null=True, blank=True, editable=False)
    hardware = models.JSONField(default=dict, blank=True, editable=False)
    copies = models.JSONField(
        "model copies",
        default=dict,
        blank=True,
        editable=False,
        help_text="Models placed here whose files the node is copying from "
        "another node: bytes done, size, source, last error.",
    )
    loop_errors = models.JSONField(
        "loop errors",
        default=dict,
        blank=True,
        editable=False,
        help_text="The node supervisor's loops (heartbeat, copies, relay, "
        "reconcile) that fail now: the error and since when (written with the "
        "heartbeat; a loop that fails keeps running).",
    )
    reaches = models.JSONField(
        "links to peers",
        default=dict,
        blank=True,
        editable=False,
        help_text="For each other node this node's supervisor tried to link to "
        "at its last heartbeat: for how many seconds its links have failed "
        "(0: linked). A node that every other node fails to link to for "
        "6 s is unreachable, whatever its heartbeat.",
    )
    file_removals = models.JSONField(
        "file removals asked",
        default=dict,
        blank=True,
        editable=False,
        help_text="Models whose files the operator asked this node to delete "
        "(the admin's action Delete files from a node): each model's path as "
        "the catalog had it and when it was asked. Written by the front.",
    )
    files_removed = models.JSONField(
        "file removals carried out",
        default=dict,
        blank=True,
        editable=False,
        help_text="What this node's supervisor did with each removal asked: "
        "the request it answers (when it was asked), the bytes freed or why it "
        "refused, and when. Written by the node.",
    )
    version = models.CharField(max_length=64, blank=True, editable=False)
    tls_fingerprint = models.CharField(
        "TLS certificate SHA-256",
        max_length=64,
        blank=True,
        editable=False,
        help_text="The relay's certificate, pinned by every other node. Empty: "
        "the relay speaks plain TCP.",
    )
    db_role = models.CharField(
        "database role",
        max_length=63,
        blank=True,
        editable=False,
        help_text="The PostgreSQL role this node's supervisor logs in as "
        "(`manage.py node_db_role`): it may write this node's own rows only. "
        "Empty: the node uses the full DATABASE_URL.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["db_role"],
                condition=~models.Q(db_role=""),
                name="cluster_node_db_role_unique",
            )
        ]

    def __str__(self) -> str:
        return self.name

    def status_at(
        self, now: datetime, *, grace_s: float, unlinked_s: float = 0.0
    ) -> NodeStatus:
        """The node's status at `now` (the database's clock): unreachable once
        its heartbeats stopped UNREACHABLE_AFTER_S ago, or every other node
        failed to link to it for that long (`unlinked_s`: for how long), down
        `grace_s` later."""
        if self.revoked_at is not None:
            return NodeStatus.REVOKED
        if self.joined_at is None or self.last_heartbeat is None:
            return NodeStatus.PENDING
        silent = max(now - self.last_heartbeat, timedelta(seconds=unlinked_s))
        if silent > timedelta(seconds=UNREACHABLE_AFTER_S + grace_s):
            return NodeStatus.DOWN
        if silent > timedelta(seconds=UNREACHABLE_AFTER_S):
            return NodeStatus.UNREACHABLE
        if self.draining:
            return NodeStatus.DRAINING
        return NodeStatus.READY

    def file_removal_states(self) -> list[FileRemoval]:
        """The file removals asked of this node and their outcomes, by model
        name: the last request of each model (pending until the node answers
        that one), and an outcome whose request is gone shown as it was."""
        requests = self.file_removals if isinstance(self.file_removals, dict) else {}
        done = self.files_removed if isinstance(self.files_removed, dict) else {}
        removals = []
        for name in sorted(set(requests) | set(done)):
            request = requests.get(name) if isinstance(requests.get(name), dict) else {}
            outcome = done.get(name) if isinstance(done.get(name), dict) else {}
            asked = request.get("requested_at") or outcome.get("requested_at") or ""
            if request and outcome.get("requested_at") != asked:
                removals.append(
                    FileRemoval(model=name, requested_at=asked, state="pending")
                )
                continue
            refused = str(outcome.get("refused") or "")
            removals.append(
                FileRemoval(
                    model=name,
                    requested_at=asked,
                    state="refused" if refused else "done",
                    freed=int(outcome.get("freed") or 0),
                    refused=refused,
                    at=str(outcome.get("at") or ""),
                )
            )
        return removals


class ClusterSettings(models.Model):
    """Cluster-wide settings (one row)."""

    grace_s = models.FloatField(
        "grace period (s)",
        default=60.0,
        validators=[MinValueValidator(0.0)],
        help_text="How long an unreachable node keeps its replicas before they "
        "are placed and loaded elsewhere.",
    )
    join_token_ttl_s = models.PositiveIntegerField(
        "join token valid for (s)",
        default=3600,
        validators=[MinValueValidator(60)],
        help_text="A node's one-time join command works this long after it is shown.",
    )

    class Meta:
        verbose_name = verbose_name_plural = "cluster settings"

    def __str__(self) -> str:
        return "Cluster settings"

    @classmethod
    def load(cls) -> "ClusterSettings":
        row, _ = cls.objects.get_or_create(pk=1)
        return row
