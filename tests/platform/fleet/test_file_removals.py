"""Deleting a model's files from another node (fleet/file_removals.py): the
front refuses at once a model loaded or placed on the node and otherwise
records the request on the node's row; the node's supervisor carries out
each request once (the files under its models directory deleted, the room
freed written on its own row), refusing a model in use there, one the
catalog no longer has, or one whose path changed, each model alone; the
model admin's "Delete files from a node…" and the node's page. On
PostgreSQL: the node's own role may write the outcome on its own row only,
never the requests, and carries a removal out with nothing more."""

import importlib
import json
import uuid
from pathlib import Path

import psycopg
import pytest
from django.apps import apps as django_apps
from django.contrib.admin.models import LogEntry
from django.contrib.messages import get_messages
from django.db import connection, transaction
from django.urls import reverse
from django.utils import timezone

from catalog.models import ModelConfig
from cluster.models import Node
from fleet import file_removals
from fleet.disk import MIB, ModelInUse
from fleet.file_removals import (
    NO_SUCH_MODEL,
    RemovalRefused,
    files_removal_request,
    files_removals_carry_out,
    files_removals_follow,
)
from fleet.models import EngineState
from fleet.node_database import node_role_create, node_role_drop
from tests.factories import EngineSpecFactory, ModelConfigFactory

CHANGELIST = "admin:catalog_modelconfig_changelist"
ON_POSTGRESQL = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="node roles are PostgreSQL roles with row-level security",
)


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return path


@pytest.fixture
def models_dir(tmp_path, settings) -> Path:
    """An empty models directory, and a run dir of this host's own (no node
    identity in it)."""
    folder = tmp_path / "models"
    folder.mkdir()
    settings.MODELS_DIR = folder
    settings.RUN_DIR = tmp_path / "run"
    settings.RUN_DIR.mkdir()
    ModelConfig.objects.all().delete()  # the demo rows: paths of their own
    return folder


@pytest.fixture
def nodes(db) -> dict[str, Node]:
    """Nodes a and b, ready, each with an engine (a-cpu, b-cpu)."""
    made = {}
    for index, name in enumerate(("a", "b"), start=1):
        node = Node.objects.create(
            name=name,
            address=f"10.0.0.{index}",
            joined_at=timezone.now(),
            last_heartbeat=timezone.now(),
        )
        EngineSpecFactory(name=f"{name}-cpu", capabilities=["gguf"], node=node)
        made[name] = node
    return made


def loaded(model: str, engine: str) -> EngineState:
    """The engine's last state lists `model` resident."""
    return EngineState.objects.create(
        spec=EngineSpecFactory(name=engine),
        status="ready",
        resident_models=[{"name": model}],
    )


def row(node: Node) -> Node:
    return Node.objects.get(pk=node.pk)


def carry_out(node: Node) -> dict | None:
    """What node's supervisor does at a heartbeat."""
    return files_removals_follow(node_name=node.name)


# -- the front asks ----------------------------------------------------------------


@pytest.mark.django_db
def test_a_model_loaded_or_placed_on_the_node_is_refused_at_once(models_dir, nodes):
    """Loaded on a's engine, or with a replica placed there: ModelInUse with
    the reason, and nothing recorded. Control: a model loaded and placed on
    b only is recorded for a."""
    held = ModelConfigFactory(name="held", path="held.gguf", engine_pin="b-cpu")
    loaded("held", "a-cpu")
    pinned = ModelConfigFactory(name="pinned", path="pinned.gguf", engine_pin="a-cpu")
    elsewhere = ModelConfigFactory(name="elsewhere", path="e.gguf", engine_pin="b-cpu")
    loaded("elsewhere", "b-cpu")
    with pytest.raises(ModelInUse, match="held is loaded on a-cpu"):
        files_removal_request(node=nodes["a"], model=held)
    with pytest.raises(ModelInUse, match=r"pinned is placed on a-cpu \(replica 1\)"):
        files_removal_request(node=nodes["a"], model=pinned)
    assert row(nodes["a"]).file_removals == {}
    files_removal_request(node=nodes["a"], model=elsewhere)
    assert set(row(nodes["a"]).file_removals) == {"elsewhere"}


@pytest.mark.django_db
def test_a_request_is_recorded_on_that_nodes_row_and_asked_again_replaces_it(
    models_dir, nodes
):
    """The request holds the catalog's path and when it was asked; it shows
    pending; b's row is untouched; asking again records a later request in
    its place; a revoked node is refused."""
    model = ModelConfigFactory(name="m", path="org--m/m.gguf", engine_pin="b-cpu")
    first = files_removal_request(node=nodes["a"], model=model)
    assert row(nodes["a"]).file_removals == {
        "m": {"path": "org--m/m.gguf", "requested_at": first}
    }
    assert row(nodes["b"]).file_removals == {}
    (pending,) = row(nodes["a"]).file_removal_states()
    assert (pending.model, pending.state, pending.requested_at) == (
        "m",
        "pending",
        first,
    )
    again = files_removal_request(node=nodes["a"], model=model)
    assert again > first
    assert row(nodes["a"]).file_removals["m"]["requested_at"] == again
    Node.objects.filter(pk=nodes["b"].pk).update(revoked_at=timezone.now())
    with pytest.raises(RemovalRefused, match="revoked"):
        files_removal_request(node=row(nodes["b"]), model=model)


# -- the node carries out ----------------------------------------------------------


@pytest.mark.django_db
def test_the_node_deletes_the_files_once_and_writes_the_room_freed(models_dir, nodes):
    """The model's folder under the models directory is deleted, the bytes
    freed written on the node's own row (done); the next heartbeat finds
    nothing new (None, the row as it was); asking again is carried out
    again. Control: the files were there before the heartbeat."""
    gguf = write(models_dir / "org--m" / "m.gguf", 3 * MIB)
    model = ModelConfigFactory(name="m", path="org--m/m.gguf", engine_pin="b-cpu")
    asked = files_removal_request(node=nodes["a"], model=model)
    assert gguf.exists()
    outcome = carry_out(nodes["a"])
    assert not gguf.exists()
    assert not (models_dir / "org--m").exists()
    assert outcome["m"]["requested_at"] == asked
    assert (outcome["m"]["freed"], outcome["m"]["refused"]) == (3 * MIB, "")
    assert row(nodes["a"]).files_removed == outcome
    assert row(nodes["b"]).files_removed == {}
    (done,) = row(nodes["a"]).file_removal_states()
    assert (done.state, done.freed) == ("done", 3 * MIB)
    assert carry_out(nodes["a"]) is None
    assert row(nodes["a"]).files_removed == outcome
    assert ModelConfig.objects.filter(name="m").exists()  # its row stays
    write(gguf, MIB)
    files_removal_request(node=nodes["a"], model=model)
    assert carry_out(nodes["a"])["m"]["freed"] == MIB
    assert not gguf.exists()


@pytest.mark.django_db
def test_a_model_in_use_on_the_node_by_then_is_refused_by_the_node(models_dir, nodes):
    """Loaded on a's engine after the request: refused with the reason, the
    file kept, shown refused; once unloaded, a new request deletes it."""
    gguf = write(models_dir / "m.gguf", MIB)
    model = ModelConfigFactory(name="m", path="m.gguf", engine_pin="b-cpu")
    files_removal_request(node=nodes["a"], model=model)
    state = loaded("m", "a-cpu")
    outcome = carry_out(nodes["a"])
    assert outcome["m"]["refused"] == "m is loaded on a-cpu"
    assert outcome["m"]["freed"] == 0
    assert gguf.exists()
    (refused,) = row(nodes["a"]).file_removal_states()
    assert (refused.state, refused.refused) == ("refused", "m is loaded on a-cpu")
    state.status = "stopped"
    state.save()
    assert carry_out(nodes["a"]) is None  # that request was answered
    files_removal_request(node=nodes["a"], model=model)
    assert carry_out(nodes["a"])["m"]["freed"] == MIB
    assert not gguf.exists()


@pytest.mark.django_db
def test_a_model_not_in_the_catalog_or_moved_is_never_deleted_by_the_rows_path(
    models_dir, nodes
):
    """A request for a model the catalog no longer has is refused (its file,
    named by the request's path, stays), and so is one whose catalog path
    changed since the request (neither path deleted)."""
    gone = write(models_dir / "gone.gguf", MIB)
    old = write(models_dir / "old.gguf", MIB)
    new = write(models_dir / "new.gguf", MIB)
    model = ModelConfigFactory(name="moved", path="old.gguf", engine_pin="b-cpu")
    files_removal_request(node=nodes["a"], model=model)
    ModelConfig.objects.filter(pk=model.pk).update(path="new.gguf")
    requests = {
        **row(nodes["a"]).file_removals,
        "gone": {"path": "gone.gguf", "requested_at": "2026-01-01T00:00:00+00:00"},
    }
    outcome = files_removals_carry_out(node_name="a", requests=requests, done={})
    assert outcome["gone"]["refused"] == NO_SUCH_MODEL
    assert "its path changed since the request" in outcome["moved"]["refused"]
    assert gone.exists() and old.exists() and new.exists()


@pytest.mark.django_db
def test_one_models_failure_refuses_that_one_alone(models_dir, nodes, monkeypatch):
    """A disk error deleting one model's files (stood in for: the disk is
    real and healthy here) refuses that model with the message; the other
    model of the same heartbeat is deleted."""
    write(models_dir / "bad.gguf", MIB)
    good = write(models_dir / "good.gguf", 2 * MIB)
    for name in ("bad", "good"):
        model = ModelConfigFactory(name=name, path=f"{name}.gguf", engine_pin="b-cpu")
        files_removal_request(node=nodes["a"], model=model)
    real_delete = file_removals.model_files_delete

    def failing_for_bad(*, model):
        if model.name == "bad":
            raise OSError("Input/output error")
        return real_delete(model=model)

    monkeypatch.setattr(file_removals, "model_files_delete", failing_for_bad)
    outcome = carry_out(nodes["a"])
    assert outcome["bad"]["refused"] == "OSError: Input/output error"
    assert outcome["good"] == {**outcome["good"], "freed": 2 * MIB, "refused": ""}
    assert not good.exists()


# -- the admin ---------------------------------------------------------------------


def order(model, **extra) -> dict:
    return {"action": "files_delete_on_node", "_selected_action": [model.pk], **extra}


@pytest.mark.django_db
def test_the_action_is_offered_only_while_the_cluster_has_nodes(
    admin_client, models_dir
):
    """No node: the list offers no "Delete files from a node…"; with one it
    does (control)."""
    ModelConfigFactory(name="m", path="m.gguf")
    url = reverse(CHANGELIST)
    assert "files_delete_on_node" not in admin_client.get(url).content.decode()
    Node.objects.create(name="a", address="10.0.0.1")
    assert "files_delete_on_node" in admin_client.get(url).content.decode()


@pytest.mark.django_db
def test_the_admin_asks_the_chosen_node_once_confirmed(admin_client, models_dir, nodes):
    """With two nodes the first page asks which (with what the files take on
    each, from its heartbeat); the chosen node's confirmation names it; the
    request is recorded only once confirmed, with a message saying its
    supervisor does it and where the outcome shows, and in the history."""
    Node.objects.filter(pk=nodes["a"].pk).update(
        hardware={"disk": {"models": {"m": 3.0}, "total_mib": 100, "free_mib": 50}}
    )
    model = ModelConfigFactory(name="m", path="m.gguf", engine_pin="b-cpu")
    url = reverse(CHANGELIST)
    choice = admin_client.post(url, order(model)).content.decode()
    assert 'name="node" value="a"' in choice and 'name="node" value="b"' in choice
    assert "m 3 MiB" in choice and "m not reported yet" in choice
    page = admin_client.post(url, order(model, node="a")).content.decode()
    assert "Delete model files from node a?" in page and "Yes, I’m sure" in page
    assert 'name="node" value="a"' in page and 'value="b"' not in page
    assert "3 MiB on a" in page
    assert row(nodes["a"]).file_removals == {}  # control: not before confirming
    done = admin_client.post(url, order(model, node="a", post="yes"), follow=True)
    assert set(row(nodes["a"]).file_removals) == {"m"}
    assert row(nodes["b"]).file_removals == {}
    (said,) = [str(m) for m in get_messages(done.wsgi_request)]
    assert "Asked node a to delete the files of m" in said
    assert reverse("admin:cluster_node_change", args=[nodes["a"].pk]) in said
    assert LogEntry.objects.filter(
        object_id=str(model.pk), change_message="Asked node a to delete its files."
    ).exists()


@pytest.mark.django_db
def test_the_admin_refuses_a_model_in_use_on_the_node(admin_client, models_dir, nodes):
    """Loaded on a's engine: an error naming the node and the engine, no
    confirmation, nothing recorded, even when confirmed."""
    model = ModelConfigFactory(name="m", path="m.gguf", engine_pin="b-cpu")
    loaded("m", "a-cpu")
    url = reverse(CHANGELIST)
    for extra in ({}, {"post": "yes"}):
        answer = admin_client.post(url, order(model, node="a", **extra), follow=True)
        said = [str(m) for m in get_messages(answer.wsgi_request)]
        assert said == ["Not deleted from node a: m is loaded on a-cpu."]
        assert "Yes, I’m sure" not in answer.content.decode()
    assert row(nodes["a"]).file_removals == {}


@pytest.mark.django_db
def test_the_nodes_page_shows_each_removal_pending_done_or_refused(admin_client, nodes):
    """Fleet -> Nodes -> a: a request not answered is pending, an answered
    one shows the room freed or why it was refused."""
    Node.objects.filter(pk=nodes["a"].pk).update(
        file_removals={
            "p": {"path": "p.gguf", "requested_at": "2026-01-02T00:00:00+00:00"},
            "d": {"path": "d.gguf", "requested_at": "2026-01-01T00:00:00+00:00"},
            "r": {"path": "r.gguf", "requested_at": "2026-01-01T00:00:00+00:00"},
        },
        files_removed={
            "p": {"requested_at": "2026-01-01T00:00:00+00:00", "freed": 0},
            "d": {
                "requested_at": "2026-01-01T00:00:00+00:00",
                "freed": 3 * MIB,
                "refused": "",
                "at": "2026-01-01T00:00:02+00:00",
            },
            "r": {
                "requested_at": "2026-01-01T00:00:00+00:00",
                "freed": 0,
                "refused": "r is loaded on a-cpu",
                "at": "2026-01-01T00:00:02+00:00",
            },
        },
    )
    page = admin_client.get(reverse("admin:cluster_node_change", args=[nodes["a"].pk]))
    text = page.content.decode()
    assert "File removals" in text
    assert "d: deleted, 3 MiB freed" in text
    assert "p: pending (asked 2026-01-02" in text
    assert "r: refused (r is loaded on a-cpu)" in text


# -- PostgreSQL: the node's own role ----------------------------------------------


@pytest.fixture
def node_role(nodes):
    """Node a's own database role (named for this run, dropped at the end)."""
    credentials = node_role_create(
        node=nodes["a"], role=f"rh_test_{uuid.uuid4().hex[:16]}"
    )
    yield credentials
    node_role_drop(node=Node.objects.get(pk=nodes["a"].pk))


def outcome_of(cursor, sql: str, params=()) -> str:
    """'refused' (no privilege or a row-level check), else the rows written."""
    try:
        cursor.execute(sql, params)
    except psycopg.errors.InsufficientPrivilege:
        return "refused"
    return f"{cursor.rowcount} rows"


@ON_POSTGRESQL
@pytest.mark.django_db(transaction=True)
def test_the_node_role_writes_the_outcome_on_its_own_row_only(node_role):
    """As node a's role: `files_removed` of its own row is written; b's is
    not, and neither is `file_removals` (the front's), its own or b's; the
    refused writes pass with the full credentials (the control)."""
    outcome = json.dumps({"m": {"requested_at": "x", "freed": 1, "refused": ""}})
    refused = [
        ("UPDATE cluster_node SET files_removed = %s WHERE name = 'b'", [outcome]),
        ("UPDATE cluster_node SET file_removals = '{}' WHERE name = 'a'", []),
        ("UPDATE cluster_node SET file_removals = '{}' WHERE name = 'b'", []),
    ]
    with psycopg.connect(node_role.database_url(), autocommit=True) as node_db:
        cursor = node_db.cursor()
        own = "UPDATE cluster_node SET files_removed = %s WHERE name = 'a'"
        assert outcome_of(cursor, own, [outcome]) == "1 rows"
        for sql, params in refused:
            assert outcome_of(cursor, sql, params) in ("refused", "0 rows"), sql
            with transaction.atomic(), connection.cursor() as full:
                full.execute(sql, params)
                assert full.rowcount == 1, sql
                transaction.set_rollback(True)
    assert Node.objects.get(name="a").files_removed["m"]["freed"] == 1
    assert Node.objects.get(name="b").files_removed == {}


@ON_POSTGRESQL
@pytest.mark.django_db(transaction=True)
def test_the_node_carries_a_removal_out_on_its_role_alone(models_dir, node_role):
    """The front asks; the supervisor's carry-out, run as node a's role (the
    ORM's session set to it), reads what it needs (the catalog, engines,
    pulls), deletes the file and writes the outcome. A role made before this
    feature (no read of the pulls, no write of files_removed) keeps the file
    (the pulls' read refuses the removal) and cannot write the outcome
    (raises: the request stays unanswered); the migration grants both, and
    the next heartbeat carries it out."""
    gguf = write(models_dir / "m.gguf", MIB)
    model = ModelConfigFactory(name="m", path="m.gguf", engine_pin="b-cpu")

    def as_node_role():
        with connection.cursor() as cursor:
            cursor.execute(f'SET ROLE "{node_role.role}"')
        try:
            return carry_out(Node.objects.get(name="a"))
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET ROLE")

    files_removal_request(node=Node.objects.get(name="a"), model=model)
    outcome = as_node_role()
    assert (outcome["m"]["freed"], outcome["m"]["refused"]) == (MIB, "")
    assert not gguf.exists()
    assert Node.objects.get(name="a").files_removed == outcome

    write(gguf, MIB)
    with connection.cursor() as cursor:  # the role as an older version made it
        cursor.execute(
            f'REVOKE UPDATE (files_removed) ON cluster_node FROM "{node_role.role}"'
        )
        revoke = f'REVOKE SELECT ON catalog_modelpull FROM "{node_role.role}"'  # noqa: S608
        cursor.execute(revoke)
    asked = files_removal_request(node=Node.objects.get(name="a"), model=model)
    with pytest.raises(Exception, match="permission denied for table cluster_node"):
        as_node_role()
    assert gguf.exists()
    assert Node.objects.get(name="a").files_removed == outcome  # unanswered
    migration = importlib.import_module("cluster.migrations.0006_node_file_removals")
    with connection.schema_editor() as editor:
        migration.grant_to_node_roles(django_apps, editor)
    again = as_node_role()
    assert again["m"]["requested_at"] == asked
    assert (again["m"]["freed"], again["m"]["refused"]) == (MIB, "")
    assert not gguf.exists()
