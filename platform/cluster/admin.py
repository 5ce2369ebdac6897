"""Admin for nodes (Fleet -> Nodes): adding one shows its join command once;
actions drain, take back, revoke, and issue a new join command."""

from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.contrib import admin, messages
from django.db import connection
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.timezone import now

from .models import ClusterSettings, Node
from .selectors import node_status, nodes_now
from .services import (
    node_drain,
    node_join_token_issue,
    node_revoke,
)

SQLITE_NOTICE = (
    "This platform runs on {vendor}: it stays one node. Cluster mode needs "
    "PostgreSQL shared by every host (DATABASE_URL)."
)


# What the join command shows where a value is secret or only the operator
# knows it: a shell parameter that must be set (`${NAME:?what it is}`), so the
# command runs as shown once the operator exports NAME, and without it the
# shell refuses to run it, saying what is missing, instead of joining with a
# placeholder taken for a value.
LOOPBACK_NAMES = frozenset({"", "localhost", "127.0.0.1", "::1"})


def _needed(name: str, what: str) -> str:
    """A shell parameter the command cannot run without."""
    return f"${{{name}:?{what}}}"


SECRET_KEY_SHOWN = _needed(
    "SECRET_KEY", "the SECRET_KEY every host of this cluster uses"
)


def database_url_shown() -> str:
    """This cluster's database URL for a join command: its user, port and
    name as this host uses them, the password (never shown by the admin) and a
    loopback host (not reachable from another host) as placeholders."""
    db = settings.DATABASES["default"]
    user = db.get("USER") or _needed("DATABASE_USER", "the database user")
    password = ""
    if db.get("PASSWORD"):
        password = ":" + _needed("DATABASE_PASSWORD", "the database password")
    host = db.get("HOST") or ""
    if host in LOOPBACK_NAMES:
        host = _needed("DATABASE_HOST", "the database host as that host reaches it")
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"postgres://{user}{password}@{host}{port}/{db.get('NAME')}"


def redis_url_shown() -> str:
    """This cluster's REDIS_URL for a join command (its port and database
    number as set here), a password and a loopback host as placeholders; ""
    without Redis."""
    if not settings.REDIS_URL:
        return ""
    url = urlsplit(settings.REDIS_URL)
    host = url.hostname or ""
    if host in LOOPBACK_NAMES:
        host = _needed("REDIS_HOST", "the Redis host as that host reaches it")
    elif ":" in host:
        host = f"[{host}]"
    auth = ""
    if url.password is not None:
        password = _needed("REDIS_PASSWORD", "the Redis password")
        auth = f"{url.username or ''}:{password}@"
    elif url.username:
        auth = f"{url.username}@"
    port = f":{url.port}" if url.port else ""
    return urlunsplit((url.scheme, f"{auth}{host}{port}", url.path, url.query, ""))


def join_command(node: Node, token: str) -> str:
    """What to run on the node's host, from the repository's folder there:
    every variable a process of this cluster needs, with this cluster's
    values where they are not secret and shell parameters that must be set
    where they are (or only the operator knows them)."""
    redis = redis_url_shown()
    redis = f" REDIS_URL={redis}" if redis else ""
    return (
        f"ROUNDHOUSE_JOIN_TOKEN={token} DATABASE_URL={database_url_shown()}{redis} "
        f"SECRET_KEY={SECRET_KEY_SHOWN} "
        f".venv/bin/python manage.py supervise --node {node.name}"
    )


def mib_text(mib: float) -> str:
    """`312 MiB`, `1.2 GiB`, `0.5 MiB`."""
    if mib < 1:
        return f"{mib:.1f} MiB"
    if mib < 1024:
        return f"{mib:.0f} MiB"
    return f"{mib / 1024:.1f} GiB"


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "node_status",
        "relay",
        "label_list",
        "engine_list",
        "heartbeat_age",
        "hardware_summary",
        "disk_free",
        "version",
        "link_security",
    ]
    search_fields = ["name", "address"]
    fields = ["name", "address", "relay_port", "labels"]
    readonly_fields = []
    actions = ["drain", "undrain", "revoke", "new_join_command"]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return []
        return [
            "node_status",
            "joined_at",
            "last_heartbeat",
            "hardware",
            "disk",
            "copy_progress",
            "file_removal_list",
            "loop_error_list",
            "peer_links",
            "version",
            "tls_fingerprint",
            "db_role",
            "engine_list",
            "revoked_at",
        ]

    def get_fields(self, request, obj=None):
        if obj is None:
            return self.fields
        return [*self.fields, *self.get_readonly_fields(request, obj)]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return connection.vendor == "postgresql" and super().has_add_permission(request)

    def changelist_view(self, request: HttpRequest, extra_context=None):
        if connection.vendor != "postgresql":
            self.message_user(
                request,
                SQLITE_NOTICE.format(vendor=connection.vendor),
                messages.WARNING,
            )
        # One read of every node's status for the whole list.
        self._statuses = {name: view.status.label for name, view in nodes_now().items()}
        return super().changelist_view(request, extra_context)

    def save_model(self, request, obj: Node, form, change) -> None:
        super().save_model(request, obj, form, change)
        if not change:
            self._show_join_command(request, obj, node_join_token_issue(node=obj))

    def _show_join_command(self, request, node: Node, token: str) -> None:
        """The join command, shown this once (only its hash is kept)."""
        self.message_user(
            request,
            format_html(
                "Run this on the host that is to be node {}, in Roundhouse's "
                "folder after <code>make setup</code> (shown once; valid for {} "
                "minutes, one use): <pre>{}</pre>"
                "Export each variable named in <code>${{NAME:?...}}</code> "
                "first (the shell refuses to run the command without it). "
                "<code>DATABASE_URL</code>, <code>REDIS_URL</code> (the same "
                "database number) and <code>SECRET_KEY</code> must be the same "
                "on every host. If this is a host that already runs the "
                "platform (the first host): give its engine specs this node, "
                "then stop its plain <code>manage.py supervise</code> and run "
                "this instead (a plain supervisor runs no engine that belongs "
                "to a node).",
                node.name,
                round(ClusterSettings.load().join_token_ttl_s / 60),
                join_command(node, token),
            ),
            messages.SUCCESS,
        )

    @admin.display(description="status")
    def node_status(self, node: Node) -> str:
        status = getattr(self, "_statuses", {}).get(node.name)
        if status is None and node.pk is not None:  # the change form: read it
            status = node_status(node=node).label
        return status or "—"

    @admin.display(description="relay")
    def relay(self, node: Node) -> str:
        return f"{node.address}:{node.relay_port}"

    @admin.display(description="labels")
    def label_list(self, node: Node) -> str:
        return ", ".join(node.labels)

    @admin.display(description="engines")
    def engine_list(self, node: Node) -> str:
        return ", ".join(node.engines.values_list("name", flat=True)) or "—"

    @admin.display(description="last heartbeat")
    def heartbeat_age(self, node: Node) -> str:
        if node.last_heartbeat is None:
            return "never"
        return f"{(now() - node.last_heartbeat).total_seconds():.0f} s ago"

    @admin.display(description="hardware")
    def hardware_summary(self, node: Node) -> str:
        hw = node.hardware or {}
        if not hw:
            return "—"
        text = f"{hw.get('cores', '?')} cores, {hw.get('ram_mib', 0) / 1024:.0f} GiB"
        if "ram_free_mib" in hw:
            text += f" ({hw['ram_free_mib'] / 1024:.1f} GiB free)"
        for gpu in hw.get("gpus", []):
            text += f", {gpu.get('vendor', 'gpu')} {gpu.get('memory_mib', 0)} MiB"
            if "free_mib" in gpu:
                text += f" ({gpu['free_mib']} MiB free)"
        return text

    @admin.display(description="models disk free")
    def disk_free(self, node: Node) -> str:
        """The free room of its models directory's disk, from its heartbeat."""
        disk = (node.hardware or {}).get("disk") or {}
        if "free_mib" not in disk:
            return "—"
        return f"{mib_text(disk['free_mib'])} of {mib_text(disk['total_mib'])}"

    @admin.display(description="models disk")
    def disk(self, node: Node) -> str:
        """Its models directory as its heartbeat last reported it (measured
        there at most every 30 s): the disk used and free, and what each
        model's files take there."""
        disk = (node.hardware or {}).get("disk") or {}
        if not disk:
            return "not reported yet (the node's heartbeat sends it)"
        if "free_mib" not in disk:
            return disk.get("error") or "not readable"
        summary = format_html(
            "<p>{}: {} used, {} free of {}</p>",
            disk.get("models_dir", "models directory"),
            mib_text(disk["used_mib"]),
            mib_text(disk["free_mib"]),
            mib_text(disk["total_mib"]),
        )
        models = sorted((disk.get("models") or {}).items())
        rows = format_html_join(
            "", "<tr><td>{}</td><td>{}</td></tr>", ((n, mib_text(m)) for n, m in models)
        )
        table = (
            format_html(
                '<table class="node-disk"><tr><th>model</th><th>files</th></tr>{}'
                "</table>",
                rows,
            )
            if models
            else format_html("<p>{}</p>", "No catalog model has files here.")
        )
        unreadable = sorted((disk.get("unreadable") or {}).items())
        problems = format_html_join(
            "", "<p>{} could not be measured: {}</p>", unreadable
        )
        return format_html("{}{}{}", summary, table, problems)

    @admin.display(description="model copies")
    def copy_progress(self, node: Node) -> str:
        """Each model being copied here: how far, from where, what went wrong."""
        lines = []
        for model, copy in sorted((node.copies or {}).items()):
            size, done = copy.get("size") or 0, copy.get("done") or 0
            text = f"{model}: {done / 2**20:.0f} of {size / 2**20:.0f} MiB"
            if size:
                text += f" ({100 * done / size:.0f}%)"
            if copy.get("source"):
                text += f" from {copy['source']}"
            if copy.get("error"):
                text += f"; last error: {copy['error']}"
            lines.append(text)
        return "; ".join(lines) or "—"

    @admin.display(description="file removals")
    def file_removal_list(self, node: Node) -> str:
        """The model files the operator asked it to delete (the model admin's
        "Delete files from a node…"): each pending until its supervisor
        answers that request, then done with the room freed, or refused."""
        lines = []
        for removal in node.file_removal_states():
            if removal.state == "pending":
                lines.append(f"{removal.model}: pending (asked {removal.requested_at})")
            elif removal.state == "refused":
                lines.append(
                    f"{removal.model}: refused ({removal.refused}) at {removal.at}"
                )
            else:
                freed = mib_text(removal.freed / 2**20)
                lines.append(
                    f"{removal.model}: deleted, {freed} freed, at {removal.at}"
                )
        return "; ".join(lines) or "—"

    @admin.display(description="loop errors")
    def loop_error_list(self, node: Node) -> str:
        """Each of the supervisor's loops that fails now: since when, why."""
        lines = [
            f"{loop}: {error.get('error', '')} (since {error.get('since', '?')})"
            for loop, error in sorted((node.loop_errors or {}).items())
        ]
        return "; ".join(lines) or "—"

    @admin.display(description="links to peers")
    def peer_links(self, node: Node) -> str:
        """The other nodes its supervisor linked to at its last heartbeat."""
        reaches = node.reaches if isinstance(node.reaches, dict) else {}
        lines = [
            f"{peer}: linked" if seconds == 0 else f"{peer}: failing for {seconds} s"
            for peer, seconds in sorted(reaches.items())
        ]
        return "; ".join(lines) or "—"

    @admin.display(description="link")
    def link_security(self, node: Node) -> str:
        return "TLS" if node.tls_fingerprint else "plain TCP"

    @admin.action(
        description="Drain: no new requests, move its replicas", permissions=["change"]
    )
    def drain(self, request: HttpRequest, queryset) -> None:
        for node in queryset:
            node_drain(node=node)
            self.log_change(request, node, "Drained.")
        self.message_user(
            request,
            "Drained: no new requests reach its engines; streams in flight "
            "finish; its replicas are placed and loaded on other nodes.",
            messages.SUCCESS,
        )

    @admin.action(description="Take back from draining", permissions=["change"])
    def undrain(self, request: HttpRequest, queryset) -> None:
        for node in queryset:
            node_drain(node=node, draining=False)
            self.log_change(request, node, "Taken back from draining.")
        self.message_user(request, "The nodes take new requests again.")

    @admin.action(
        description="Revoke: its secret stops working now", permissions=["change"]
    )
    def revoke(self, request: HttpRequest, queryset) -> None:
        for node in queryset:
            node_revoke(node=node)
            self.log_change(request, node, "Revoked.")
        self.message_user(
            request,
            "Revoked: the other nodes' relays refuse its links and close the "
            "open ones; its supervisor stops. Its database credentials are not "
            "revoked by this: change them if the host is not trusted any more.",
            messages.WARNING,
        )

    @admin.action(description="New join command", permissions=["change"])
    def new_join_command(self, request: HttpRequest, queryset) -> None:
        for node in queryset:
            if node.revoked_at is not None:
                self.message_user(
                    request, f"{node.name} is revoked: add it again.", messages.ERROR
                )
                continue
            self._show_join_command(request, node, node_join_token_issue(node=node))
            self.log_change(request, node, "New join token issued.")


@admin.register(ClusterSettings)
class ClusterSettingsAdmin(admin.ModelAdmin):
    """The one row of cluster settings (made on first read)."""

    fields = ["grace_s", "join_token_ttl_s"]

    def changelist_view(self, request: HttpRequest, extra_context=None):
        ClusterSettings.load()
        return super().changelist_view(request, extra_context)

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
