"""The supervisor's loops survive their errors (platform/fleet/loop_errors.py):
a catalog row whose path no host can use, or any error in one heartbeat,
leaves the heartbeat beating (the error logged once and shown on the node's
admin page), the other models still copied; a bad path is refused at save; a
loop thread that stopped ends the supervisor with its own exit code."""

import asyncio
import os
import socket
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.urls import reverse
from node_link.client import LinkPool
from node_link.files import model_digests

from catalog.models import ModelConfig, ModelPathError, model_path_resolve
from cluster.models import Node
from cluster.services import node_create, node_join
from engines.wire.framing import encode_message
from fleet import model_copies
from fleet.engine_processes import Timing
from fleet.loop_errors import LoopErrors
from fleet.membership import Membership
from fleet.model_copies import ModelCopies
from fleet.peer_links import PeerLinks, Reckoning
from fleet.supervisor import LOOP_STOPPED_EXIT, Supervisor
from tests.engines.conftest import free_port
from tests.factories import ModelConfigFactory
from tests.platform.node_link.file_relay import pinned_relay
from tests.waiting import await_for, wait_for

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


# -- each loop's guard, with an unexpected error in some passes ------------------


class Failing:
    """A pass that raises RuntimeError(message) its first `times` calls,
    then does `then` (the real pass); counts its calls."""

    def __init__(self, message: str, times: int, then=lambda *a, **k: None):
        self.message = message
        self.left = times
        self.then = then
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.left:
            self.left -= 1
            raise RuntimeError(self.message)
        return self.then(*args, **kwargs)


def test_an_error_in_a_reconcile_pass_is_shown_and_the_loop_goes_on(
    tmp_path, monkeypatch, caplog
):
    """Passes of the supervisor's loop that fail: the error is logged once,
    shown in its loop errors ("reconcile") while it lasts, the passes go on
    and, once one works, the error is cleared (control: without the guard
    the first error ends run() and its thread)."""
    supervisor = Supervisor(run_dir=tmp_path, timing=Timing(tick=0.01))
    tick = Failing("a reconcile pass that broke", 10**6)
    monkeypatch.setattr(supervisor, "tick", tick)
    thread = threading.Thread(target=supervisor.run, name="supervisor")
    thread.start()
    try:
        wait_for(lambda: tick.calls >= 3, what="three failing passes")
        shown = supervisor.errors.report()["reconcile"]
        assert shown["error"] == "RuntimeError: a reconcile pass that broke"
        assert shown["since"] and thread.is_alive()
        tick.left = 0  # the passes work again
        wait_for(lambda: "reconcile" not in supervisor.errors.report(), what="cleared")
        assert thread.is_alive()
        assert logged(caplog, "the reconcile loop failed") == 1
        assert logged(caplog, "the reconcile loop works again") == 1
    finally:
        supervisor.stopping.set()
        thread.join(10)


def test_an_error_no_task_of_the_relay_handled_is_shown_and_the_relay_serves(
    tmp_path, caplog
):
    """Two errors that escape a task on the relay's event loop (the loop's
    exception handler gets them): shown in the loop errors as "relay",
    logged once; the loop and its relay go on: a connection gets the relay's
    answer afterwards (control: without the handler the error reaches no
    loop error)."""
    membership = Membership(name="n2", run_dir=tmp_path, errors=LoopErrors())
    membership._bind = ("127.0.0.1", free_port())
    thread = threading.Thread(target=membership._relay_main, name="relay")
    membership._threads.append(thread)
    thread.start()
    try:
        assert membership._relay_ready.wait(30) and membership._relay_error is None

        async def broken() -> None:
            raise RuntimeError("a relay task that broke")

        for _ in range(2):
            membership._loop.call_soon_threadsafe(
                lambda: membership._loop.create_task(broken())
            )
        wait_for(
            lambda: "relay" in membership.errors.report(), what="the relay's error"
        )
        shown = membership.errors.report()["relay"]["error"]
        assert shown == "RuntimeError: a relay task that broke"
        host, port = membership.relay_address
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(encode_message({"kind": "not a hello"}))
            answer = sock.recv(4096)
        assert b"link refused" in answer
        assert thread.is_alive() and membership.stopped_loop() is None
        assert logged(caplog, "the relay loop failed") == 1
    finally:
        membership.stop()


async def test_an_error_in_a_peer_links_round_is_shown_and_the_rounds_go_on(
    monkeypatch, caplog
):
    """Three rounds of the peer links fail: logged once, shown as "peer
    links" while it lasts, the rounds go on, and the next that works clears
    it and is reckoned (control: without the guard the first error ends
    the rounds' task)."""
    links = PeerLinks(LinkPool(node="a", secret="peer-secret", plain_tcp=True))
    errors = LoopErrors()
    reckoned: list[Reckoning] = []

    async def reckon(reckoning: Reckoning) -> None:
        reckoned.append(reckoning)

    round_ = Failing("a round that broke", 3, then=links.round)
    monkeypatch.setattr(links, "round", round_)
    rounds = asyncio.ensure_future(links.run(0.01, reckon, errors))
    try:
        await await_for(lambda: "peer links" in errors.report(), what="the error")
        assert (
            errors.report()["peer links"]["error"] == "RuntimeError: a round that broke"
        )
        await await_for(lambda: reckoned, what="a round that worked")
        assert "peer links" not in errors.report()
        assert round_.calls > 3 and not rounds.done()
        assert logged(caplog, "the peer links loop failed") == 1
    finally:
        rounds.cancel()
        links.close()


async def test_an_error_in_a_model_copy_is_shown_and_the_copy_tried_again(
    tmp_path, monkeypatch, caplog
):
    """A copy that fails twice on an error no one expected (not a peer's
    failure): shown as "copies of m" (the copy's own report says to see the
    log), logged once, the copy is no longer running and is tried again at
    its retry time; the third try copies the model and clears the error
    (control: without the guard the error reaches neither the loop errors
    nor the report)."""
    monkeypatch.setattr(model_copies, "RETRY_S", 0)
    source = tmp_path / "m.gguf"
    source.write_bytes(os.urandom(50_000))
    relay, peer = await pinned_relay(
        tmp_path, {"m": source}, secret="copies-secret", node="b", caller="f"
    )
    errors = LoopErrors()
    copies = ModelCopies(
        node="f", secret="copies-secret", plain_tcp=True, errors=errors
    )
    copy = Failing("a copy that broke", 2, then=model_copies.copy_model)
    monkeypatch.setattr(model_copies, "copy_model", copy)
    dest = tmp_path / "f-models" / "m.gguf"
    loop = asyncio.get_running_loop()

    def want() -> None:
        copies.want({"m": dest}, {"m": [peer]}, loop, {"m": model_digests(source)})

    try:
        for calls in (1, 2):
            want()
            await await_for(
                lambda calls=calls: (
                    copy.calls == calls
                    and "m" in copies.report()
                    and copies.report()["m"]["error"]
                    and "copies of m" in errors.report()
                ),
                what=f"failure {calls}",
            )
            assert "see the supervisor's log" in copies.report()["m"]["error"]
            await await_for(lambda: not copies._copies["m"].running, what="ended")
        shown = errors.report()["copies of m"]["error"]
        assert shown == "RuntimeError: a copy that broke"
        want()
        await await_for(lambda: not copies.missing(), what="the copy")
        assert dest.read_bytes() == source.read_bytes()
        assert "copies of m" not in errors.report()
        assert logged(caplog, "the copies of m loop failed") == 1
    finally:
        copies.close()
        await relay.close()
