"""The supervisor's loops survive their errors (platform/fleet/loop_errors.py):
a catalog row whose path no host can use, or any error in one heartbeat,
leaves the heartbeat beating (the error logged once and shown on the node's
admin page), the other models still copied; a bad path is refused at save; a
loop thread that stopped ends the supervisor with its own exit code."""

import asyncio
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.urls import reverse

from catalog.models import ModelConfig, ModelPathError, model_path_resolve
from cluster.models import Node
from cluster.services import node_create, node_join
from fleet.loop_errors import LoopErrors
from fleet.membership import Membership
from fleet.model_copies import ModelCopies
from fleet.supervisor import LOOP_STOPPED_EXIT, Supervisor
from tests.factories import ModelConfigFactory
from tests.waiting import wait_for

BAD_PATHS = {"no-user": "~nosuchuser/m.gguf", "too-long": "x" * 300 + "/m.gguf"}

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="nodes need PostgreSQL"
)


@pytest.mark.django_db
@pytest.mark.parametrize("path", BAD_PATHS.values())
def test_a_path_no_host_can_use_is_refused_at_save(path):
    """(control: a good path saves)"""
    with pytest.raises(ModelPathError):
        model_path_resolve(path)
    model = ModelConfigFactory.build(path=path)
    with pytest.raises(ValidationError) as refused:
        model.full_clean()
    assert "path" in refused.value.message_dict
    ModelConfigFactory.build(path="good/m.gguf").full_clean()


@pytest.fixture
def beating(transactional_db, tmp_path, monkeypatch):
    """A node's heartbeat thread against the test database, with three
    models placed on its engine: two whose paths are bad rows already in the
    catalog and one good whose files are missing here (so it is copied)."""
    node, join = node_create(name="n2", address="127.0.0.1")
    identity = node_join(name="n2", join_token=join)
    for name, path in BAD_PATHS.items():
        ModelConfig.objects.create(
            name=name, format="gguf", task="chat", path=path
        )  # as a row written before the check: no clean
    ModelConfigFactory(name="good", path=str(tmp_path / "missing.gguf"))
    membership = Membership(name="n2", run_dir=tmp_path, errors=LoopErrors())
    membership.identity = identity
    membership.copies = ModelCopies(node="n2", secret=identity.secret, plain_tcp=True)
    membership._loop = asyncio.new_event_loop()  # never run: no peer to copy from
    monkeypatch.setattr(
        Membership,
        "_placed_here",
        lambda self, snapshot: {"e": frozenset({*BAD_PATHS, "good"})},
    )
    thread = threading.Thread(target=membership._beat_main, name="heartbeat")
    membership._threads.append(thread)
    yield membership, node, thread
    membership._stopping.set()
    thread.join(10)
    membership._loop.close()


def beats_after(node: Node) -> callable:
    """True once the node's row shows a heartbeat newer than now."""
    node.refresh_from_db()
    seen = node.last_heartbeat

    def newer() -> bool:
        node.refresh_from_db()
        return node.last_heartbeat != seen

    return newer


@postgres_only
def test_bad_catalog_paths_fail_their_models_alone(beating, admin_client):
    """The heartbeat goes on beating, the good model is still copied, and the
    bad paths show on the node's admin page (control: before, the first bad
    row's RuntimeError or OSError ended the heartbeat thread)."""
    membership, node, thread = beating
    thread.start()
    wait_for(
        lambda: Node.objects.get(pk=node.pk).loop_errors.get("model paths"),
        what="the bad paths on the node's row",
    )
    error = Node.objects.get(pk=node.pk).loop_errors["model paths"]["error"]
    assert "no-user" in error and "too-long" in error
    assert "good" not in error
    assert "good" in membership.copies.report()  # still wanted: copied
    wait_for(beats_after(node), what="a later heartbeat")
    assert thread.is_alive()
    page = admin_client.get(reverse("admin:cluster_node_change", args=[node.pk]))
    assert "model paths" in page.content.decode()
    assert "nosuchuser" in page.content.decode()


@postgres_only
def test_any_error_in_a_beat_is_shown_and_the_beat_goes_on(beating, monkeypatch):
    """An unexpected error in every beat: logged once, on the node's row,
    and the next beats still come (control: without the guard the thread
    ends at the first)."""
    membership, node, thread = beating

    def broken(self, snapshot):
        raise RuntimeError("boom")

    monkeypatch.setattr(Membership, "_copy_missing", broken)
    thread.start()
    wait_for(
        lambda: (
            "boom"
            in Node.objects.get(pk=node.pk)
            .loop_errors.get("heartbeat", {})
            .get("error", "")
        ),
        what="the error on the node's row",
    )
    wait_for(beats_after(node), what="a later heartbeat")
    assert thread.is_alive()
    assert membership.errors.report()["heartbeat"]["error"] == "RuntimeError: boom"


def test_a_loop_error_is_logged_once_until_it_changes_or_clears(caplog):
    errors = LoopErrors()
    for _ in range(3):
        with errors.guard("heartbeat"):
            raise RuntimeError("same")
    assert logged(caplog, "RuntimeError: same") == 1
    with errors.guard("heartbeat"):
        raise OSError("other")
    assert logged(caplog, "OSError: other") == 1
    with errors.guard("heartbeat"):
        pass
    assert errors.report() == {}
    assert logged(caplog, "works again") == 1


def logged(caplog, text: str) -> int:
    return sum(text in record.getMessage() for record in caplog.records)


def test_a_stopped_loop_thread_ends_the_supervisor_with_its_code(tmp_path):
    """(control: while the thread runs, the supervisor goes on)"""
    supervisor = Supervisor(run_dir=tmp_path, node="n1")
    running = threading.Event()
    thread = threading.Thread(target=running.wait, name="heartbeat")
    thread.start()
    supervisor.membership._threads.append(thread)
    supervisor._notice_stopped_loops()
    assert supervisor.exit_code is None and not supervisor.stopping.is_set()
    running.set()
    thread.join()
    supervisor._notice_stopped_loops()
    assert supervisor.exit_code == LOOP_STOPPED_EXIT
    assert supervisor.stopping.is_set()


@pytest.mark.django_db
def test_bad_rows_leave_the_other_models_servable(tmp_path):
    """An engine's servable models leave a bad row out and keep the others
    (control: before, resolving the first bad path raised for all)."""
    from catalog.selectors import model_paths, models_servable_by

    for name, path in BAD_PATHS.items():
        ModelConfig.objects.create(name=name, format="gguf", task="chat", path=path)
    ModelConfigFactory(name="good", format="gguf", path="good.gguf")
    served = {m["name"] for m in models_servable_by(capabilities=frozenset({"gguf"}))}
    assert "good" in served and not served & set(BAD_PATHS)
    assert set(model_paths({*BAD_PATHS, "good"})) == {"good"}
