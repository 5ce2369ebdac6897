"""A node's own database role (PostgreSQL): a host that runs only a supervisor
logs in with credentials that read what its supervisor reads and write only
its own rows, so that one compromised host cannot rewrite the cluster.

What a node's supervisor (`supervise --node NAME`: membership.py, recorder.py,
model_copies.py) touches, and so all its role is granted:

- reads (SELECT, every row): the nodes (its peers' addresses, certificate
  fingerprints and secret hashes, to reach them and to check the ones that
  call its relay), the cluster settings, the engine specs and states (its own
  engines to run; everyone's residency, for placement and for whom to copy a
  model from), the server, thermal and concurrency settings with their
  overrides (each engine's configuration), the catalog's models, and the
  model pulls (a model's files are not deleted from the node while a pull
  writes into their folder: file_removals.py);
- writes, its own node's row only, while it is not revoked: the heartbeat
  columns (last_heartbeat, updated_at, hardware, version, tls_fingerprint,
  copies, loop_errors, reaches), the outcome of the file removals asked of it
  (files_removed; never the removals asked, file_removals, which the front
  writes) and the join's (secret_hash, join_token_hash, join_token_expires_at,
  joined_at);
- writes, its own engines' states only (EngineState rows whose spec is on its
  node): INSERT and UPDATE of every column;
- writes, any catalog model: the memory a load measured (measured_memory_mib,
  measured_device_memory_mib, measured_at) and nothing else of the row.

Nothing else: no DELETE anywhere, no other column or table (users, API keys,
chats, batches, the catalog's paths). Columns are confined by GRANTs; rows by
row-level security: the migrations (cluster 0003, fleet 0009) turn it on for
the node and engine-state tables with one permissive policy for every role
(nothing changes for the front's connection, which owns the tables or is a
superuser and bypasses row security anyway: FORCE is not set), and each node
role gets restrictive policies of its own (`TO` that role alone) that keep its
updates and inserts to its node's rows. Per-role policies need no lookup of
"is this a node role" inside a policy on the node table itself (which
PostgreSQL would reject as recursive), and leave every other role as it was.
"""

import contextlib
import re
import secrets
from dataclasses import dataclass

from django.db import DatabaseError, connection, transaction

from catalog.models import ModelConfig, ModelPull
from cluster.models import ClusterSettings, Node

from .models import (
    ConcurrencyOverride,
    ConcurrencySettings,
    EngineSpec,
    EngineState,
    ServerSettings,
    ThermalOverride,
    ThermalSettings,
)

# The heartbeat's columns (cluster.services.node_heartbeat), the outcome of
# the file removals asked of the node (file_removals.py) and the join's
# (node_join), of the node's own row.
NODE_COLUMNS = (
    "last_heartbeat",
    "updated_at",
    "hardware",
    "version",
    "tls_fingerprint",
    "copies",
    "loop_errors",
    "reaches",
    "files_removed",
    "secret_hash",
    "join_token_hash",
    "join_token_expires_at",
    "joined_at",
)
# What a load measured (catalog.services.model_memory_record).
MODEL_COLUMNS = ("measured_memory_mib", "measured_device_memory_mib", "measured_at")
# A node role's sessions: the recorder, the heartbeat, the relay's checks,
# reconnects; more would be a node doing something else.
CONNECTION_LIMIT = 16
# PostgreSQL's identifiers are 63 bytes; policy names add a suffix.
ROLE_MAX = 50
ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]*")


class NodeRoleError(Exception):
    """The node's role cannot be made or dropped; `str()` says why."""


@dataclass(frozen=True)
class NodeCredentials:
    """A node's role and its password (shown once, kept nowhere)."""

    role: str
    password: str

    def __repr__(self) -> str:  # never the password
        return f"NodeCredentials(role={self.role!r})"

    def database_url(self) -> str:
        """This database, as the node's supervisor reaches it with the role."""
        db = connection.settings_dict
        host = db.get("HOST") or "DB-HOST"
        port = f":{db['PORT']}" if db.get("PORT") else ""
        return f"postgres://{self.role}:{self.password}@{host}{port}/{db['NAME']}"


def node_reads() -> list[str]:
    """The tables a node's supervisor reads."""
    return [
        model._meta.db_table
        for model in (
            Node,
            ClusterSettings,
            EngineSpec,
            EngineState,
            ServerSettings,
            ThermalSettings,
            ThermalOverride,
            ConcurrencySettings,
            ConcurrencyOverride,
            ModelConfig,
            ModelPull,
        )
    ]


def node_role_default(node: Node) -> str:
    """A role name for the node: this database's and the node's name (roles
    are shared by every database of a PostgreSQL server)."""
    name = f"rh_{connection.settings_dict['NAME']}_{node.name}".lower()
    name = "".join(char if char.isascii() and char.isalnum() else "_" for char in name)
    return name[:ROLE_MAX]


def _quote(name: str) -> str:
    return connection.ops.quote_name(name)


def _role_exists(cursor, role: str) -> bool:
    cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
    return cursor.fetchone() is not None


def _password_verifier(role: str, password: str) -> str:
    """The SCRAM-SHA-256 verifier of the password, made here: the statement
    that sets it (and any server log of it) never holds the password."""
    connection.ensure_connection()
    verifier = connection.connection.pgconn.encrypt_password(
        password.encode(), role.encode(), b"scram-sha-256"
    ).decode()
    if "'" in verifier or "\\" in verifier:  # base64 and '$:' only
        raise NodeRoleError("unexpected password verifier")
    return verifier


def _own_engines() -> str:
    """SQL: the engine specs of the current role's node, while not revoked."""
    spec = _quote(EngineSpec._meta.db_table)
    node = _quote(Node._meta.db_table)
    # Identifiers only, from the models, quoted.
    return (
        f"(SELECT spec.id FROM {spec} spec JOIN {node} node "  # noqa: S608
        "ON node.id = spec.node_id "
        "WHERE node.db_role = current_user AND node.revoked_at IS NULL)"
    )


def _grant(cursor, role: str) -> None:
    """The role's privileges and its restrictive policies (again: idempotent)."""
    who = _quote(role)
    node_table = _quote(Node._meta.db_table)
    state_table = _quote(EngineState._meta.db_table)
    model_table = _quote(ModelConfig._meta.db_table)
    cursor.execute(f"GRANT USAGE ON SCHEMA {_quote(_schema(cursor))} TO {who}")
    for table in node_reads():
        cursor.execute(f"GRANT SELECT ON {_quote(table)} TO {who}")
    columns = ", ".join(_quote(column) for column in NODE_COLUMNS)
    cursor.execute(f"GRANT UPDATE ({columns}) ON {node_table} TO {who}")
    cursor.execute(f"GRANT INSERT, UPDATE ON {state_table} TO {who}")
    columns = ", ".join(_quote(column) for column in MODEL_COLUMNS)
    cursor.execute(f"GRANT UPDATE ({columns}) ON {model_table} TO {who}")
    own_node = "db_role = current_user AND revoked_at IS NULL"
    own_state = f"spec_id IN {_own_engines()}"
    policies = [
        (node_table, "UPDATE", f"USING ({own_node}) WITH CHECK ({own_node})"),
        (state_table, "UPDATE", f"USING ({own_state}) WITH CHECK ({own_state})"),
        (state_table, "INSERT", f"WITH CHECK ({own_state})"),
    ]
    for table, command, clauses in policies:
        policy = _quote(f"{role}_{command.lower()}")
        cursor.execute(f"DROP POLICY IF EXISTS {policy} ON {table}")
        cursor.execute(
            f"CREATE POLICY {policy} ON {table} AS RESTRICTIVE FOR {command} "
            f"TO {who} {clauses}"
        )


def _schema(cursor) -> str:
    cursor.execute("SELECT current_schema()")
    return cursor.fetchone()[0]


def _singletons() -> None:
    """The settings rows a supervisor reads exist (it may not create them)."""
    for model in (
        ClusterSettings,
        ServerSettings,
        ThermalSettings,
        ConcurrencySettings,
    ):
        model.load()


def node_role_create(*, node: Node, role: str = "") -> NodeCredentials:
    """Make (or give a new password to) the node's login role, grant it what
    a node's supervisor needs and nothing more, and record it on the node.
    NodeRoleError on SQLite, for a name another role or node has, or when
    this connection may not create roles."""
    if connection.vendor != "postgresql":
        raise NodeRoleError("node roles need PostgreSQL (cluster mode)")
    role = role or node.db_role or node_role_default(node)
    if len(role) > ROLE_MAX or not ROLE_NAME.fullmatch(role):
        raise NodeRoleError(
            f"role name {role!r}: lower-case letters, digits and _ only, at most "
            f"{ROLE_MAX} characters"
        )
    if node.revoked_at is not None:
        raise NodeRoleError(f"node {node.name!r} is revoked")
    if node.db_role and node.db_role != role:
        raise NodeRoleError(
            f"node {node.name!r} has role {node.db_role!r}: drop it first (--drop)"
        )
    if Node.objects.filter(db_role=role).exclude(pk=node.pk).exists():
        raise NodeRoleError(f"role {role!r} belongs to another node")
    password = secrets.token_urlsafe(32)
    _singletons()
    with transaction.atomic(), connection.cursor() as cursor:
        exists = _role_exists(cursor, role)
        if exists and node.db_role != role:
            raise NodeRoleError(
                f"a role {role!r} exists already (roles are shared by every "
                "database of the server): choose another with --role"
            )
        verifier = _password_verifier(role, password)
        attributes = (
            "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION "
            f"NOBYPASSRLS CONNECTION LIMIT {CONNECTION_LIMIT} PASSWORD '{verifier}'"
        )
        verb = "ALTER" if exists else "CREATE"
        try:
            cursor.execute(f"{verb} ROLE {_quote(role)} {attributes}")
        except DatabaseError as error:
            raise NodeRoleError(
                f"cannot {verb.lower()} role {role!r}: {error}".strip()
                + " (the database user needs CREATEROLE)"
            ) from error
        _grant(cursor, role)
        Node.objects.filter(pk=node.pk).update(db_role=role)
    node.db_role = role
    return NodeCredentials(role=role, password=password)


def node_role_grant_all() -> list[str]:
    """Grant every node role again what a supervisor needs now (after an
    upgrade whose supervisor writes a new column), a revoked node's never;
    the roles."""
    if connection.vendor != "postgresql":
        return []
    roles = list(
        Node.objects.exclude(db_role="")
        .filter(revoked_at__isnull=True)
        .order_by("name")
        .values_list("db_role", flat=True)
    )
    _singletons()
    with transaction.atomic(), connection.cursor() as cursor:
        for role in roles:
            if _role_exists(cursor, role):
                _grant(cursor, role)
    return roles


def node_role_drop(*, node: Node) -> str:
    """Drop the node's role: its privileges and policies in this database,
    then the role (NodeRoleError when it still has some in another one)."""
    if connection.vendor != "postgresql":
        raise NodeRoleError("node roles need PostgreSQL (cluster mode)")
    role = node.db_role
    if not role:
        raise NodeRoleError(f"node {node.name!r} has no database role")
    failure: DatabaseError | None = None
    with transaction.atomic(), connection.cursor() as cursor:
        if _role_exists(cursor, role):
            cursor.execute(f"ALTER ROLE {_quote(role)} NOLOGIN")
            # Its open sessions end too, where this user may end them.
            with contextlib.suppress(DatabaseError), transaction.atomic():
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE usename = %s",
                    [role],
                )
            cursor.execute(f"DROP OWNED BY {_quote(role)}")
            try:
                with transaction.atomic():
                    cursor.execute(f"DROP ROLE {_quote(role)}")
            except DatabaseError as error:
                failure = error  # kept on the node: --drop again once it can
        if failure is None:
            Node.objects.filter(pk=node.pk).update(db_role="")
    if failure is not None:
        raise NodeRoleError(
            f"role {role!r} can no longer log in and has nothing here, but "
            f"cannot be dropped: {failure}"
        )
    node.db_role = ""
    return role
