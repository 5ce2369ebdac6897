"""Nodes failing, cut off, drained and revoked, on a real cluster of network
namespaces: what a client of another node sees, and what the cluster does."""

import json
import sys
import threading
import time
from collections import Counter

from django.utils import timezone

from batches.models import Batch, BatchLine
from batches.services import LEASE_S
from catalog.models import ModelConfig
from cluster.models import Node
from cluster.services import node_drain, node_revoke
from tests.cluster.cluster_setup import (
    GRACE_S,
    EventStream,
    chat,
    fleet_view,
    http,
    model_row,
    node_status,
    routed,
    wait_resident,
)
from tests.cluster.netns import start_worker
from tests.conftest import ROOT
from tests.platform.batches.jobs import chat_line, jsonl, records, wait_batch
from tests.waiting import wait_for

# Greedy SmolLM2 answers this until its context is full (about 10 s).
LONG = "Write the numbers from 1 to 500, separated by commas."


def ask(node, model: str, key: str, content: str = "Say hi.", timeout: float = 120):
    status, headers, body = http(
        f"{node.url}/v1/chat/completions",
        body=chat(model, content),
        key=key,
        timeout=timeout,
    )
    return status, headers.get("X-Roundhouse-Node"), body


def refused_within(
    node, model: str, key: str, timeout: float, seen: list
) -> tuple | None:
    """The answer to one request if it is a refusal; None if it is served, or
    not answered within `timeout` (for a wait that asks again). Each outcome
    is added to `seen` (status, node, error; or how long it went unanswered),
    for the message of a wait that times out."""
    started = time.monotonic()
    try:
        outcome = ask(node, model, key, timeout=timeout)
    except OSError as error:  # timed out (urllib wraps a connect's in URLError)
        seen.append(f"unanswered after {time.monotonic() - started:.1f} s: {error}")
        return None
    error = outcome[2].get("error") if isinstance(outcome[2], dict) else None
    seen.append((outcome[0], outcome[1], error, f"{time.monotonic() - started:.1f} s"))
    return _refused(outcome)


INSIDE = """
import json, sys, time, urllib.error, urllib.request
request = urllib.request.Request(
    "http://127.0.0.1:8000/v1/chat/completions",
    data=sys.argv[1].encode(),
    headers={
        "Content-Type": "application/json",
        "Authorization": "Bearer " + sys.argv[2],
    },
)
sent = time.monotonic()
try:
    with urllib.request.urlopen(request, timeout=60) as reply:
        status, body = reply.status, reply.read().decode()
except urllib.error.HTTPError as error:
    status, body = error.code, error.read().decode()
print(status, sent, time.monotonic(), body)
"""


def ask_inside(
    node, model: str, key: str, answers: list | None = None
) -> tuple[int, dict]:
    """A request to the node's front from its own host (its loopback): what
    a client beside a cut-off node gets. `answers` collects (status, sent,
    answered: time.monotonic(), which the namespaces share, taken around the
    request alone)."""
    done = node.host.run(
        [sys.executable, "-c", INSIDE, json.dumps(chat(model, "Hi")), key], timeout=90
    )
    status, sent, answered, body = done.stdout.split(" ", 3)
    assert status.isdigit(), done.stderr
    if answers is not None:
        answers.append((int(status), float(sent), float(answered)))
    return int(status), json.loads(body)


def test_a_node_cut_off_is_routed_around_and_stops_serving(cluster, orm):
    """iptables DROP on node b (alive, unreachable): within 10 s the cluster
    takes it for unreachable and a's clients are served by a's replica of
    smol; b's own front, unable to confirm where anything runs, refuses
    (cluster_unconfirmed) instead of answering as if it still owned work,
    and goes on refusing. Reconnected, b is ready again and serves again.
    Printed, not asserted (no timing assertions): the time from the cut to
    b's first refusal and each refusal's latency (bench/partition.py
    measures them with more clients)."""
    a, b = cluster.nodes["a"], cluster.nodes["b"]
    # A client of b's front before: b knows the key (a key b never saw is
    # refused while b cannot reach the database anyway).
    assert ask_inside(b, "smol", cluster.key)[0] == 200
    b.host.cut_off()
    try:
        cut_at = time.monotonic()
        wait_for(
            lambda: node_status("b") == "unreachable",
            timeout=20,
            what="node b to be unreachable",
        )
        print(f"node b unreachable after {time.monotonic() - cut_at:.1f} s")
        for n in range(4):
            status, node, body = ask(a, "smol", cluster.key, f"Name a colour, {n}.")
            assert (status, node) == (200, "a"), body
        # Nowhere else to run smol-b: refused, whether front a's view of the
        # fleet already shows b unreachable or it tried b's link in vain.
        status, _, body = ask(a, "smol-b", cluster.key)
        assert status == 503, body
        assert body["error"]["code"] in ("no_engine", "engine_unreachable"), body
        inside: list[tuple[int, float, float]] = []
        status, body = wait_for(
            lambda: _refused(ask_inside(b, "smol", cluster.key, inside)),
            timeout=30,
            what="b's front to refuse",
        )
        assert body["error"]["code"] == "cluster_unconfirmed", body
        for _ in range(3):  # it goes on refusing
            status, body = ask_inside(b, "smol", cluster.key, inside)
            assert status == 503, body
            assert body["error"]["code"] == "cluster_unconfirmed", body
    finally:
        b.host.reconnect()
    refusals = [(sent, answered) for status, sent, answered in inside if status == 503]
    print(
        f"b's front: first 503 cluster_unconfirmed "
        f"{refusals[0][1] - cut_at:.1f} s after the cut (asked from "
        f"{inside[0][1] - cut_at:.1f} s on, one request at a time); refusals took "
        + ", ".join(f"{answered - sent:.2f}" for sent, answered in refusals)
        + " s; before them: "
        + (
            ", ".join(
                f"{status} in {answered - sent:.2f} s"
                for status, sent, answered in inside
                if status != 503
            )
            or "none"
        )
    )
    # Back, b must not take a for unreachable: what b failed to link to while
    # it was cut off itself says nothing of a. a's status is read all along,
    # until both nodes report their links to each other made again.
    a_seen = Counter()

    def status_of(name: str) -> str:
        a_seen[node_status("a")] += 1
        return node_status(name)

    wait_for(lambda: status_of("b") == "ready", timeout=30, what="b ready again")
    status, node, body = wait_for(
        lambda: status_of("b") and _served(ask(a, "smol-b", cluster.key)),
        timeout=30,
        what="smol-b served again",
    )
    assert node == "b"

    def relinked() -> bool:
        status_of("a")
        reaches = dict(Node.objects.values_list("name", "reaches"))
        return reaches["a"].get("b") == 0 and reaches["b"].get("a") == 0

    wait_for(relinked, timeout=30, what="a and b linked to each other again")
    assert set(a_seen) == {"ready"}, f"{a_seen}\n{fleet_view()}"
    status, body = ask_inside(b, "smol", cluster.key)
    assert status == 200, body


def _refused(outcome):
    return outcome if outcome[0] == 503 else None


def _refused_for(outcome, reason: str):
    """A refusal whose message gives `reason`; None for anything else."""
    refused = _refused(outcome)
    return refused if refused and reason in refused[2]["error"]["message"] else None


def _served(outcome):
    return outcome if outcome[0] == 200 else None


def test_a_drained_node_finishes_its_streams_and_takes_no_new_requests(cluster, orm):
    """A stream on node b goes on to its end after b is drained; new requests
    for smol go to a only, and smol-b (which may run on b only) has nowhere
    to go. Taken back, b serves again."""
    a = cluster.nodes["a"]
    stream = EventStream(a, chat("smol-b", LONG, max_tokens=60), cluster.key)
    events = stream.events()
    next(events)
    node_drain(node=Node.objects.get(name="b"))
    try:
        wait_for(lambda: node_status("b") == "draining", timeout=10, what="draining")
        rest = list(events)
        stream.close()
        assert rest[-1]["choices"][0]["finish_reason"] in ("stop", "length"), rest[-1]
        # Once front a's view of the fleet shows the drain (it is read at most
        # a second or a few old), smol-b, which may run on b only, has nowhere
        # to go, and every smol request goes to a.
        status, _, body = wait_for(
            lambda: _refused(ask(a, "smol-b", cluster.key)),
            timeout=20,
            what="front a to see b drained",
        )
        assert body["error"]["code"] == "no_engine", body
        for n in range(4):
            status, node, body = ask(a, "smol", cluster.key, f"Say {n}.")
            assert (status, node) == (200, "a"), f"{body}\n{fleet_view()}"
    finally:
        node_drain(node=Node.objects.get(name="b"), draining=False)
    outcomes = []
    try:
        wait_for(
            lambda: _served(
                outcomes.append(ask(a, "smol-b", cluster.key)) or outcomes[-1]
            ),
            timeout=20,
            what="b back",
        )
    except AssertionError:
        raise AssertionError(f"{outcomes[-1]} {node_status('b')}") from None


class Load:
    """Requests sent one after another from a thread until stopped; every
    outcome kept (status, node)."""

    def __init__(self, node, model: str, key: str) -> None:
        self.outcomes: list[tuple[int, str | None, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(node, model, key), daemon=True
        )
        self._thread.start()

    def _run(self, node, model, key) -> None:
        n = 0
        while not self._stop.is_set():
            self.outcomes.append(ask(node, model, key, f"Say the number {n}."))
            n += 1

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(120)
        return self.outcomes


def test_every_process_of_a_node_sigkilled(cluster, orm):
    """Node c holds a replica of smol-c (pinned there; a second replica on
    another node). SIGKILL every process of c mid-stream: the stream ends
    with engine_died; requests sent meanwhile that had not reached c are
    answered by the other replica (none lost), and one c had taken when it
    died (at most one: the load sends one at a time) is answered
    engine_died, not sent to another engine; c is unreachable within 10 s,
    and after the grace period its replica is placed and loaded on another
    node."""
    a = cluster.nodes["a"]
    c = cluster.add_node("c", labels=["spare"])
    model_row("smol-c", replicas=2, engine_pin="ec", node_labels=["spare"])
    try:
        wait_resident("smol-c", {"ec"})
        first_placed = set(_placed("smol-c"))
        assert "ec" in first_placed and len(first_placed) == 2
        wait_resident("smol-c", first_placed)
        stream = EventStream(
            a, chat("smol-c", LONG, max_tokens=2000, temperature=0), cluster.key
        )
        assert stream.headers["X-Roundhouse-Node"] == "c"
        events = stream.events()
        next(events)
        load = Load(a, "smol-c", cluster.key)
        wait_for(lambda: len(load.outcomes) >= 2, timeout=60, what="load running")
        c.host.kill_all()
        killed_at = time.monotonic()
        rest = list(events)
        stream.close()
        assert rest[-1]["error"]["code"] == "engine_died", rest[-1]
        wait_for(
            lambda: node_status("c") in ("unreachable", "down"),
            timeout=20,
            what="node c unreachable",
        )
        print(f"node c unreachable after {time.monotonic() - killed_at:.1f} s")
        wait_for(lambda: node_status("c") == "down", timeout=GRACE_S + 20, what="down")
        survivors = set(_placed("smol-c"))
        assert "ec" not in survivors and len(survivors) == 2
        wait_resident("smol-c", survivors)
        outcomes = load.stop()
        failed = [o for o in outcomes if o[0] != 200]
        assert len(failed) <= 1, failed
        assert all(o[2]["error"]["code"] == "engine_died" for o in failed), failed
        assert {node for _, node, _ in outcomes[-3:]} <= {"a", "b"}
    finally:
        ModelConfig.objects.filter(name="smol-c").delete()
        cluster.remove_node("c")


def _placed(model: str) -> tuple[str, ...]:
    from fleet.selectors import routing_snapshot

    return routing_snapshot().placed(model)


def test_a_revoked_node_is_cut_off_at_once(cluster, orm):
    """Node d serves smol-d and its front reaches b. Revoked: a's clients no
    longer reach d's engine, d's link to b is closed and refused by b's
    relay (its secret stops working), and d's supervisor stops."""
    a = cluster.nodes["a"]
    d = cluster.add_node("d", labels=["zone-d"])
    model_row("smol-d", slots=1, node_labels=["zone-d"])
    try:
        wait_resident("smol-d", {"ed"})
        assert ask(a, "smol-d", cluster.key)[:2] == (200, "d")
        assert ask(d, "smol-b", cluster.key)[:2] == (200, "b")
        node_revoke(node=Node.objects.get(name="d"))
        assert node_status("d") == "revoked"
        # A request in flight when b's relay dropped d's link fails (502);
        # from then on d's link is refused (the one answer a relay gives
        # every refusal), and b's relay logs why: d's revocation.
        status, _, body = wait_for(
            lambda: _refused_for(ask(d, "smol-b", cluster.key), "link refused"),
            timeout=15,
            what="d's requests to b refused",
        )
        assert status == 503, body
        wait_for(
            lambda: (
                f"relay refused a link from {d.host.address}: node 'd' is "
                "revoked" in cluster.nodes["b"].log()
            ),
            timeout=15,
            what="b's relay to log d's revocation as the reason",
        )
        # Others stop routing to d once their view of the fleet shows it
        # revoked (a second or so), or d's relay refuses (its next beat).
        status, _, body = wait_for(
            lambda: _refused(ask(a, "smol-d", cluster.key)),
            timeout=15,
            what="a's requests to d refused",
        )
        assert status == 503, body
        supervisor = d.processes["supervisor"]
        supervisor.wait(60)
        assert "is revoked" in d.log()
    finally:
        ModelConfig.objects.filter(name="smol-d").delete()
        cluster.remove_node("d")


def test_a_batch_on_a_dead_nodes_worker_is_finished_elsewhere_once(cluster, orm):
    """Node c's worker runs a batch (its host named rh-c: the lease names its
    owner's host); every process of c is SIGKILLed once a few lines are
    recorded. When the run's lease has expired, a worker started on node a
    resumes it: every line answered exactly once, the lines recorded before
    the kill kept as they were."""
    a = cluster.nodes["a"]
    c = cluster.add_node("c", labels=[])
    client = a.client(cluster.key)
    total = 30
    lines = [
        chat_line(f"k{n}", f"Count to {n + 3}.", model="smol", max_tokens=24)
        for n in range(total)
    ]
    start_worker(c.host, "worker-c", env=c.env, log_dir=c.log_dir, root=ROOT)
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    survivor = None
    try:
        wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 4)
        assert Batch.objects.get(pk=batch.id).lease_owner.startswith("rh-c:")
        c.host.kill_all()
        before = dict(
            BatchLine.objects.filter(batch_id=batch.id).values_list("index", "record")
        )
        assert 4 <= len(before) < total, "the kill came too late to test a resume"
        wait_for(
            lambda: Batch.objects.get(pk=batch.id).lease_until < timezone.now(),
            timeout=LEASE_S + 15,
            what="c's lease to expire",
        )
        survivor = start_worker(
            a.host, "worker-a", env=a.env, log_dir=a.log_dir, root=ROOT
        )
        done = wait_batch(client, batch.id)
        assert done.status == "completed", done
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (total, total, 0)
        answered = Counter(r["custom_id"] for r in records(client, done.output_file_id))
        assert answered == Counter(f"k{n}" for n in range(total))
        after = dict(
            BatchLine.objects.filter(batch_id=batch.id).values_list("index", "record")
        )
        assert all(after[index] == record for index, record in before.items())
    finally:
        if survivor is not None:
            survivor.terminate()
            survivor.wait(60)
        cluster.remove_node("c")


def _drop(node, chain: str, port_side: str, port: int) -> None:
    """Drop, on `node`'s host, TCP packets in `chain` to or from `port`
    (undone by reconnect(), which flushes the chains)."""
    node.host.run(
        ["iptables", "-A", chain, "-p", "tcp", port_side, str(port), "-j", "DROP"],
        check=True,
    )


def _relay_port(name: str) -> int:
    return Node.objects.get(name=name).relay_port


def test_a_node_whose_relay_no_one_reaches_loses_its_replica(cluster, orm):
    """Node c's relay port dropped on c (a partial partition: c still writes
    its heartbeat, its own links to a and b still work): a and b, which link
    to each other, fail to link to c, so within a few heartbeats the cluster
    takes c for unreachable, after the grace period for down, and c's
    replica of smol-c is placed and loaded on another node and served there.
    Control: c's heartbeat stays current throughout (by its heartbeat alone c
    is ready), and before the block smol-c was c's."""
    a = cluster.nodes["a"]
    c = cluster.add_node("c", labels=["spare"])
    model_row("smol-c", engine_pin="ec", node_labels=["spare"])
    try:
        wait_resident("smol-c", {"ec"})
        assert _placed("smol-c") == ("ec",)
        assert routed(a, "smol-c", cluster.key)[1]["X-Roundhouse-Node"] == "c"
        _drop(c, "INPUT", "--dport", _relay_port("c"))
        blocked_at = time.monotonic()
        wait_for(
            lambda: node_status("c") in ("unreachable", "down"),
            timeout=30,
            what="node c unreachable for its links",
        )
        print(f"node c unreachable after {time.monotonic() - blocked_at:.1f} s")
        wait_for(lambda: node_status("c") == "down", timeout=GRACE_S + 20, what="down")
        from cluster.selectors import nodes_now

        assert nodes_now()["c"].heartbeat_age_s < 6, "c stopped beating"
        reaches = {
            name: row.reaches
            for name, row in Node.objects.in_bulk(field_name="name").items()
        }
        assert reaches["a"]["c"] > 6 and reaches["a"]["b"] == 0, reaches
        # c's own links work (one may be made again now and then: a loaded
        # host's relay can miss a hello).
        wait_for(
            lambda: Node.objects.get(name="c").reaches.get("a") == 0,
            timeout=15,
            what="c's report that it links to a",
        )
        moved = set(_placed("smol-c"))
        assert moved and "ec" not in moved, moved
        wait_resident("smol-c", moved)
        assert routed(a, "smol-c", cluster.key)[1]["X-Roundhouse-Node"] in ("a", "b")
    finally:
        c.host.reconnect()
        ModelConfig.objects.filter(name="smol-c").delete()
        cluster.remove_node("c")


def test_a_database_outage_for_every_node_is_served_through(cluster, orm):
    """PostgreSQL dropped on every host (the nodes still reach each other's
    relays): each node's links say the outage is everyone's, so both fronts
    go on serving smol past the 6 s after which a node cut off alone refuses
    (from the test's side of the database, both nodes are unreachable then).
    Control, in the same outage: b's relay port dropped too, a reaches no
    peer and refuses (cluster_unconfirmed), while b, which still reaches a,
    serves on. The database back, both are ready and serve."""
    a, b = cluster.nodes["a"], cluster.nodes["b"]
    # smol on a and b (an earlier test may have moved a replica), and both
    # fronts know the key (in the outage they cannot look it up).
    wait_resident("smol", {"ea", "eb"})
    for node in (a, b):
        routed(node, "smol", cluster.key)
    assert ask_inside(b, "smol", cluster.key)[0] == 200
    try:
        for node in (a, b):
            _drop(node, "OUTPUT", "--dport", 5432)
        wait_for(
            lambda: {node_status("a"), node_status("b")} <= {"unreachable", "down"},
            timeout=30,
            what="both nodes past their last heartbeat",
        )
        served_until = time.monotonic() + 8
        answers = []
        while time.monotonic() < served_until or len(answers) < 4:
            for node in (a, b):  # for 8 s, and two rounds at least
                status, _, body = ask(node, "smol", cluster.key, "Say yes.")
                answers.append((node.name, status, body))
        refused = [answer for answer in answers if answer[1] != 200]
        assert not refused, refused
        _drop(b, "INPUT", "--dport", _relay_port("b"))
        # A request sent to b as its port closed waits for the link's
        # keepalive to give up on b; the wait asks again meanwhile.
        seen = []
        try:
            status, _, body = wait_for(
                lambda: refused_within(a, "smol", cluster.key, 15, seen),
                timeout=60,
                what="a to refuse once it reaches no peer",
            )
        except AssertionError as error:
            raise AssertionError(
                f"{error}; answers: {seen}\n{a.log('front')[-3000:]}"
            ) from None
        assert body["error"]["code"] == "cluster_unconfirmed", body
        status, body = ask_inside(b, "smol", cluster.key)
        assert status == 200, body
    finally:
        for node in (a, b):
            node.host.reconnect()
    wait_for(
        lambda: {node_status("a"), node_status("b")} == {"ready"},
        timeout=30,
        what="both nodes ready again",
    )
    for node in (a, b):
        wait_for(
            lambda node=node: _served(ask(node, "smol", cluster.key)),
            timeout=30,
            what=f"{node.name} serving again",
        )
