"""A node's own database role (`manage.py node_db_role NAME`): logged in with
it, a node writes its heartbeat and its own engines' states, and every write
issue 31 lists of a compromised node is refused (its own revocation, another
node's secret, fingerprint or address, another node's engines' residency, the
catalog's rows), while the same writes pass with the full credentials; a real
supervisor joins, beats, runs an engine and records a measurement with the
role alone. PostgreSQL only: roles and row-level security are PostgreSQL's
(cluster mode needs it). Each role is named for its test run and dropped."""

import importlib
import io
import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.apps import apps as django_apps
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone

from catalog.models import ModelConfig
from cluster.models import Node
from cluster.services import node_create, node_join_token_issue, node_revoke
from fleet.file_removals import files_removal_request
from fleet.models import EngineSpec, EngineState, ServerSettings
from fleet.node_database import node_role_drop
from tests.conftest import ROOT
from tests.platform.fleet.live_fleet import EMBEDDER, Fleet, stop_leftovers
from tests.platform.live import free_port_block
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="node roles are PostgreSQL roles with row-level security (cluster "
        "mode needs PostgreSQL); SQLite runs one node",
    ),
]


def role_name() -> str:
    """A role of this test run only (roles are shared by the whole server)."""
    return f"rh_test_{uuid.uuid4().hex[:16]}"


def role_exists(role: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        return cursor.fetchone() is not None


def make_role(node: str, role: str) -> str:
    """The DATABASE_URL the command prints for the node's new role."""
    out = io.StringIO()
    call_command("node_db_role", node, "--role", role, stdout=out, stderr=io.StringIO())
    (line,) = out.getvalue().splitlines()
    assert line.startswith("DATABASE_URL=postgres://")
    return line.removeprefix("DATABASE_URL=")


@pytest.fixture
def drop_roles():
    """Roles the test makes, dropped at its end whatever happened."""
    made: list[str] = []
    yield made
    for role in made:
        node = Node.objects.filter(db_role=role).first()
        if node is not None:
            node_role_drop(node=node)
        if role_exists(role):  # made but never recorded on a node
            with connection.cursor() as cursor:
                cursor.execute(f'DROP OWNED BY "{role}"')
                cursor.execute(f'DROP ROLE "{role}"')
        assert not role_exists(role)


def state_insert(spec_id: int) -> tuple[str, list]:
    """An engine state row in SQL, every NOT NULL column given."""
    return (
        "INSERT INTO fleet_enginestate (spec_id, status, resident_models, "
        "slots_in_use, queue_depth, cooling_reason, temperatures, "
        "tokens_generated, restart_count, last_error) "
        "VALUES (%s, 'ready', %s, 0, 0, '', '[]', 0, 0, '')",
        [spec_id, json.dumps([{"name": "secret-model", "memory_mib": 1}])],
    )


def outcome(cursor, sql: str, params=()) -> str:
    """What became of a write: 'refused' (no privilege, or a row-level
    security check), else how many rows it wrote."""
    try:
        cursor.execute(sql, params)
    except psycopg.errors.InsufficientPrivilege:
        return "refused"
    return f"{cursor.rowcount} rows"


def with_full_credentials(sql: str, params=()) -> str:
    """The same write on the front's connection, rolled back afterwards."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)
        written = f"{cursor.rowcount} rows"
        transaction.set_rollback(True)
    return written


@pytest.fixture
def two_nodes():
    """Nodes a and b, each with an engine that has a state, and a second
    engine of each without one; a catalog model."""
    nodes = {}
    for name in ("a", "b"):
        node, _ = node_create(name=name, address=f"10.0.0.{len(nodes) + 1}")
        Node.objects.filter(pk=node.pk).update(
            secret_hash="0" * 64, tls_fingerprint="f" * 64, joined_at=timezone.now()
        )
        spec = EngineSpec.objects.create(name=f"{name}-cpu", backend="cpu", node=node)
        EngineState.objects.create(spec=spec, status="ready")
        EngineSpec.objects.create(name=f"{name}-spare", backend="cpu", node=node)
        nodes[name] = node
    ModelConfig.objects.create(
        name="served", format="gguf", task="chat", path="served.gguf"
    )
    return nodes


def test_a_node_role_writes_its_own_rows_and_nothing_else(two_nodes, drop_roles):
    """Logged in as node a's role, every write a compromised node would try is
    refused (no privilege, or no row of its own to write), while a's heartbeat,
    its engines' states and a load's measurement pass; the refused writes pass
    with the full credentials (the front's), which row security leaves as
    they were."""
    role = role_name()
    drop_roles.append(role)
    url = make_role("a", role)
    b_cpu = EngineSpec.objects.get(name="b-cpu").pk
    b_spare = EngineSpec.objects.get(name="b-spare").pk
    a_cpu = EngineSpec.objects.get(name="a-cpu").pk
    a_spare = EngineSpec.objects.get(name="a-spare").pk
    resident = json.dumps([{"name": "served", "memory_mib": 1}])
    refused = {
        "another node's secret hash": (
            "UPDATE cluster_node SET secret_hash = %s WHERE name = 'b'",
            ["1" * 64],
        ),
        "another node's certificate fingerprint": (
            "UPDATE cluster_node SET tls_fingerprint = %s WHERE name = 'b'",
            ["e" * 64],
        ),
        "another node's heartbeat": (
            "UPDATE cluster_node SET last_heartbeat = now() WHERE name = 'b'",
            [],
        ),
        "another node's address": (
            "UPDATE cluster_node SET address = '10.6.6.6' WHERE name = 'b'",
            [],
        ),
        "its own address": (
            "UPDATE cluster_node SET address = '10.6.6.6' WHERE name = 'a'",
            [],
        ),
        "its own labels (to draw models that require one)": (
            "UPDATE cluster_node SET labels = '[\"trusted\"]' WHERE name = 'a'",
            [],
        ),
        "taking back its own drain": (
            "UPDATE cluster_node SET draining = false WHERE name = 'a'",
            [],
        ),
        "its own role (to hand it on)": (
            "UPDATE cluster_node SET db_role = 'x' WHERE name = 'a'",
            [],
        ),
        "another node's role (to write as that node)": (
            "UPDATE cluster_node SET db_role = 'y' WHERE name = 'b'",
            [],
        ),
        "deleting another node": ("DELETE FROM cluster_node WHERE name = 'b'", []),
        "a model resident on another node's engine": (
            "UPDATE fleet_enginestate SET resident_models = %s WHERE spec_id = %s",
            [resident, b_cpu],
        ),
        "a state for another node's engine": state_insert(b_spare),
        "moving another node's engine onto its own": (
            "UPDATE fleet_enginespec SET node_id = %s WHERE id = %s",
            [two_nodes["a"].pk, b_cpu],
        ),
        "its own engines' specs (env, devices)": (
            "UPDATE fleet_enginespec SET env = '{}' WHERE id = %s",
            [a_cpu],
        ),
        "a catalog model's path (planted files)": (
            "UPDATE catalog_modelconfig SET path = '/tmp/planted.gguf' "
            "WHERE name = 'served'",
            [],
        ),
        "a catalog model's file digests (to pass planted files)": (
            "UPDATE catalog_modelconfig SET file_digests = %s WHERE name = 'served'",
            [json.dumps({"": "a" * 64})],
        ),
        "a catalog model's replicas": (
            "UPDATE catalog_modelconfig SET replicas = 9 WHERE name = 'served'",
            [],
        ),
        "deleting a catalog model": (
            "DELETE FROM catalog_modelconfig WHERE name = 'served'",
            [],
        ),
        "the cluster's settings": (
            "UPDATE cluster_clustersettings SET grace_s = 0",
            [],
        ),
    }
    with psycopg.connect(url, autocommit=True) as node_db:
        cursor = node_db.cursor()
        assert (
            outcome(
                cursor,
                "UPDATE cluster_node SET last_heartbeat = now(), hardware = %s, "
                "copies = '{}', loop_errors = '{}' WHERE name = 'a' "
                "AND revoked_at IS NULL",
                [json.dumps({"cores": 2})],
            )
            == "1 rows"
        )
        assert (
            outcome(
                cursor,
                "UPDATE fleet_enginestate SET resident_models = %s, "
                "heartbeat_at = now() WHERE spec_id = %s",
                [resident, a_cpu],
            )
            == "1 rows"
        )
        assert outcome(cursor, *state_insert(a_spare)) == "1 rows"
        assert (
            outcome(
                cursor,
                "UPDATE catalog_modelconfig SET measured_memory_mib = 300, "
                "measured_at = now() WHERE name = 'served'",
            )
            == "1 rows"
        )

        for what, (sql, params) in refused.items():
            assert outcome(cursor, sql, params) in ("refused", "0 rows"), what
            assert with_full_credentials(sql, params) != "0 rows", what

        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            cursor.execute("SELECT * FROM api_apikey")

        # Revoked (here only its row: the row-level policies alone, as where
        # the front's user may not take the role's privileges away), it
        # cannot clear its revocation and writes nothing of its own any more.
        Node.objects.filter(name="a").update(revoked_at=timezone.now())
        revoked = {
            "clearing its own revocation": (
                "UPDATE cluster_node SET revoked_at = NULL WHERE name = 'a'",
                [],
            ),
            "its heartbeat once revoked": (
                "UPDATE cluster_node SET last_heartbeat = now() WHERE name = 'a'",
                [],
            ),
            "its engines' states once revoked": (
                "UPDATE fleet_enginestate SET heartbeat_at = now() WHERE spec_id = %s",
                [a_cpu],
            ),
        }
        for what, (sql, params) in revoked.items():
            assert outcome(cursor, sql, params) in ("refused", "0 rows"), what
            assert with_full_credentials(sql, params) != "0 rows", what

    node = Node.objects.get(name="a")
    assert node.revoked_at is not None
    assert node.db_role == role
    other = Node.objects.get(name="b")
    assert (other.secret_hash, other.tls_fingerprint) == ("0" * 64, "f" * 64)
    assert EngineState.objects.get(spec_id=b_cpu).resident_models == []


def test_the_password_is_printed_once_and_kept_only_as_a_verifier(
    two_nodes, drop_roles
):
    """The command prints the role's password in the one DATABASE_URL line;
    PostgreSQL keeps a SCRAM verifier of it, and no row holds it."""
    role = role_name()
    drop_roles.append(role)
    url = make_role("a", role)
    password = url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert len(password) >= 40
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", [role])
        (stored,) = cursor.fetchone()
        assert stored.startswith("SCRAM-SHA-256$")
        assert password not in stored
        cursor.execute("SELECT row_to_json(n)::text FROM cluster_node n")
        assert not any(password in row for (row,) in cursor.fetchall())


def test_dropping_a_node_role_removes_it(two_nodes, drop_roles):
    """`node_db_role NAME --drop` drops the role (and its policies), its open
    session can do nothing more, and the node has no role; the control: the
    role existed with its policies and its session read."""
    role = role_name()
    drop_roles.append(role)
    url = make_role("a", role)
    assert role_exists(role)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_policies WHERE %s = ANY(roles)", [role])
        assert cursor.fetchone()[0] == 3
    session = psycopg.connect(url, autocommit=True)
    assert session.execute("SELECT count(*) FROM cluster_node").fetchone() == (2,)
    call_command("node_db_role", "a", "--drop", stderr=io.StringIO())
    with pytest.raises(psycopg.Error):
        session.execute("SELECT count(*) FROM cluster_node")
    session.close()
    assert not role_exists(role)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_policies WHERE %s = ANY(roles)", [role])
        assert cursor.fetchone()[0] == 0
    assert Node.objects.get(name="a").db_role == ""


def test_revoking_a_node_ends_its_roles_reads_too(two_nodes, drop_roles):
    """Revoking a node (the admin's action) takes every table from its role,
    for its open session as well, and neither --grant-all nor a new password
    gives them back; the control: that session read before."""
    role = role_name()
    drop_roles.append(role)
    url = make_role("a", role)
    with psycopg.connect(url, autocommit=True) as node_db:
        read = "SELECT count(*) FROM cluster_node"
        assert node_db.execute(read).fetchone() == (2,)
        node_revoke(node=Node.objects.get(name="a"))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            node_db.execute(read)
    call_command("node_db_role", "--grant-all", stderr=io.StringIO())
    with psycopg.connect(url, autocommit=True) as node_db:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            node_db.execute(read)
    with pytest.raises(CommandError, match="revoked"):
        make_role("a", role)


def test_grant_all_gives_every_node_role_what_it_lacks(two_nodes, drop_roles):
    """After an upgrade, `node_db_role --grant-all` grants each node role again
    what the supervisor needs: a privilege taken away (the control: the write
    is refused then) is back, and no password is printed."""
    role = role_name()
    drop_roles.append(role)
    url = make_role("a", role)
    measure = (
        "UPDATE catalog_modelconfig SET measured_memory_mib = 300 WHERE name = 'served'"
    )
    with connection.cursor() as cursor:
        cursor.execute(f'REVOKE UPDATE ON catalog_modelconfig FROM "{role}"')
    with psycopg.connect(url, autocommit=True) as node_db:
        assert outcome(node_db.cursor(), measure) == "refused"
        out = io.StringIO()
        call_command("node_db_role", "--grant-all", stdout=out, stderr=io.StringIO())
        assert out.getvalue() == ""
        assert outcome(node_db.cursor(), measure) == "1 rows"


def test_a_role_name_taken_by_the_server_is_refused(two_nodes, drop_roles):
    """Roles are shared by every database of a server: a name that exists
    already (another cluster's node, anyone's) is refused, not taken over;
    the node keeps no role."""
    role = role_name()
    drop_roles.append(role)
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{role}" LOGIN')
    with pytest.raises(CommandError, match="exists already"):
        make_role("a", role)
    assert Node.objects.get(name="a").db_role == ""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_policies WHERE %s = ANY(roles)", [role])
        assert cursor.fetchone()[0] == 0


def test_a_supervisor_runs_on_its_node_role_alone(
    two_nodes, drop_roles, models_dir, tmp_path, settings
):
    """`supervise --node a` with the role's DATABASE_URL joins with its token,
    beats, runs its engine, writes its state and the measured memory of the
    model it loads, carries out a file removal asked of it (and refuses one
    of the model it holds), and logs no refused write (a refused one would
    show as the database 'unavailable' and keep the state unwritten)."""
    for spec in EngineSpec.objects.exclude(name="a-cpu"):
        spec.delete()
    ModelConfig.objects.all().delete()
    ModelConfig.objects.create(
        name=EMBEDDER,
        format="embedding",
        task="embedding",
        path="all-MiniLM-L6-v2",
    )
    port = free_port_block(2)
    ServerSettings.load()
    EngineSpec.objects.filter(name="a-cpu").update(port=port)
    EngineState.objects.all().delete()
    node = two_nodes["a"]
    Node.objects.filter(pk=node.pk).update(
        address="127.0.0.1",
        relay_port=port + 1,
        secret_hash="",
        joined_at=None,
        tls_fingerprint="",
    )
    node.refresh_from_db()
    token = node_join_token_issue(node=node)
    role = role_name()
    drop_roles.append(role)
    url = make_role("a", role)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    temperatures = tmp_path / "temperatures.json"
    temperatures.write_text(json.dumps({"cpu": 50}))
    env = {
        **os.environ,
        "ROUNDHOUSE_THERMAL_FILE": str(temperatures),
        "DATABASE_URL": url,
        "ROUNDHOUSE_RUN_DIR": str(run_dir),
        "ROUNDHOUSE_MODELS_DIR": str(settings.MODELS_DIR),
        "ROUNDHOUSE_JOIN_TOKEN": token,
        "ROUNDHOUSE_RELAY_BIND": "127.0.0.1",
        "SECRET_KEY": "node-role-tests-not-secret",
    }
    fleet = Fleet(run_dir=run_dir, env=env, base_port=port, temperatures=temperatures)
    scratch = Path(settings.MODELS_DIR) / f"removal-{uuid.uuid4().hex}.gguf"
    scratch.write_bytes(b"\0" * 4096)
    log_path = run_dir / "supervisor-test.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "supervise", "--node", "a"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    fleet.processes.append(process)
    try:

        def loaded():
            assert process.poll() is None, fleet.supervisor_log()
            state = EngineState.objects.filter(spec__name="a-cpu").first()
            model = ModelConfig.objects.get(name=EMBEDDER)
            return (
                state is not None
                and state.status == "ready"
                and EMBEDDER in state.resident_model_names
                and model.measured_memory_mib
            )

        wait_for(loaded, timeout=180, what="a-cpu ready with the model loaded")
        node.refresh_from_db()
        assert node.secret_hash and node.joined_at and node.hardware
        beat = node.last_heartbeat
        wait_for(
            lambda: Node.objects.get(pk=node.pk).last_heartbeat > beat,
            what="a later heartbeat",
        )
        # A file removal asked of the node (fleet/file_removals.py): carried
        # out by its supervisor on its role alone, and one for the model it
        # holds loaded refused by the node itself (asked behind the front's
        # own check, which would refuse it first).
        spare = ModelConfig.objects.create(  # placed nowhere: no node has the label
            name="spare",
            format="gguf",
            task="chat",
            path=scratch.name,
            node_labels=["elsewhere"],
        )
        files_removal_request(node=node, model=spare)
        Node.objects.filter(pk=node.pk).update(
            file_removals={
                **Node.objects.get(pk=node.pk).file_removals,
                EMBEDDER: {"path": "all-MiniLM-L6-v2", "requested_at": "now"},
            }
        )

        def answered():
            states = Node.objects.get(pk=node.pk).file_removal_states()
            return None if any(s.state == "pending" for s in states) else states

        states = {s.model: s for s in wait_for(answered, what="removals answered")}
        assert states["spare"].state == "done" and states["spare"].freed == 4096
        assert not scratch.exists()
        assert states[EMBEDDER].state == "refused", states
        assert "loaded on a-cpu" in states[EMBEDDER].refused
        assert (Path(settings.MODELS_DIR) / "all-MiniLM-L6-v2").is_dir()
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == 0, fleet.supervisor_log()
    finally:
        scratch.unlink(missing_ok=True)
        stop_leftovers(fleet)
    text = fleet.supervisor_log()
    assert "permission denied" not in text
    assert "row-level security" not in text
    assert "database unavailable" not in text, text
    assert node.last_heartbeat > timezone.now() - timedelta(minutes=10)


def test_the_reaches_migration_grants_the_column_to_existing_node_roles(
    two_nodes, drop_roles
):
    """A node role made before the heartbeat wrote `reaches` may write it once
    the migration that added it ran (no `--grant-all` needed for the
    upgrade). Control: the role without that grant is refused the write."""
    role = role_name()
    drop_roles.append(role)
    url = make_role("a", role)
    write = "UPDATE cluster_node SET reaches = '{\"b\": 0}' WHERE name = 'a'"
    with connection.cursor() as cursor:  # the role as an older version made it
        cursor.execute(f'REVOKE UPDATE (reaches) ON cluster_node FROM "{role}"')
    with psycopg.connect(url, autocommit=True) as node_db:
        assert outcome(node_db.cursor(), write) == "refused"
    migration = importlib.import_module("cluster.migrations.0005_node_reaches")
    with connection.schema_editor() as editor:
        migration.grant_to_node_roles(django_apps, editor)
    with psycopg.connect(url, autocommit=True) as node_db:
        assert outcome(node_db.cursor(), write) == "1 rows"
