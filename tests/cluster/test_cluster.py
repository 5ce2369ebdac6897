"""Several hosts (network namespaces made by the test) as one Roundhouse
cluster: joining, a request served by another node's engine (REST, SSE and
WebSocket), cancelling across nodes, replicas and cache-aware routing."""

import json
import os
import stat
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
from django.db import connection
from node_link.files import file_sha256
from websockets.sync.client import connect

from api.affinity import KEY_PREFIX
from api.models import Usage
from catalog.models import ModelConfig
from cluster.identity import identity_read, secret_hash
from cluster.models import Node
from fleet.models import EngineState
from tests.cluster import cluster_setup
from tests.cluster.cluster_setup import EventStream, chat, http
from tests.conftest import ROOT
from tests.platform.live import database_url
from tests.waiting import wait_for


def supervise_here(
    node: str, run_dir, *, token: str = ""
) -> subprocess.CompletedProcess:
    """`manage.py supervise --node` on this host (outside the namespaces)."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "ROUNDHOUSE_RUN_DIR": str(run_dir),
        "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
    }
    env.pop("ROUNDHOUSE_JOIN_TOKEN", None)
    if token:
        env["ROUNDHOUSE_JOIN_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "manage.py", "supervise", "--node", node],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _sessions_of(role: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [role]
        )
        return cursor.fetchone()[0]


def test_a_node_joins_once_with_its_token(cluster, orm, tmp_path):
    """Each node exchanged its one-time token for its own secret: the secret
    is in its run dir (0600) and only its hash in the database; the node
    reported its hardware, version and pinned certificate. The token does not
    work twice, and a host without one cannot join."""
    for name, node in cluster.nodes.items():
        row = Node.objects.get(name=name)
        identity = identity_read(node.run_dir)
        mode = stat.S_IMODE(os.stat(node.run_dir / "node.json").st_mode)
        assert (identity.name, mode) == (name, 0o600)
        assert row.secret_hash == secret_hash(identity.secret)
        assert identity.secret not in json.dumps(
            list(Node.objects.values()), default=str
        )
        assert row.join_token_hash == "" and row.joined_at is not None
        assert row.hardware["cores"] >= 1 and row.hardware["ram_mib"] > 0
        assert row.version and len(row.tls_fingerprint) == 64
        # After the first host, a node's supervisor runs on the node's own
        # database role (joined and heartbeating with it).
        if name != "a":
            assert row.db_role and _sessions_of(row.db_role) > 0

    again = supervise_here("a", tmp_path / "again", token=cluster.tokens["a"])
    assert again.returncode != 0
    assert "wrong or was used already" in again.stderr
    bare = supervise_here("a", tmp_path / "bare")
    assert bare.returncode != 0
    assert "has not joined as node 'a'" in bare.stderr


def test_a_request_to_node_a_is_served_by_node_b(cluster, orm):
    """smol-b is placed on node b only: front a carries it over its link to
    b's relay and b's engine answers, whole, streamed (SSE) and over the
    WebSocket chat; each answer names the node and engine, as does the usage
    row."""
    front = cluster.nodes["a"]
    status, headers, body = http(
        f"{front.url}/v1/chat/completions",
        body=chat("smol-b", "Say hi."),
        key=cluster.key,
    )
    assert status == 200, body
    assert (headers["X-Roundhouse-Node"], headers["X-Roundhouse-Engine"]) == (
        "b",
        "eb",
    )
    assert body["timings"]["node"] == "b"

    stream = EventStream(front, chat("smol-b", "Count to five."), cluster.key)
    events = list(stream.events())
    stream.close()
    assert stream.headers["X-Roundhouse-Node"] == "b"
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    with connect(f"ws://{front.host.address}:8000/ws/chat/", open_timeout=30) as ws:
        ws.send(json.dumps({"type": "auth", "key": cluster.key}))
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": "1",
                    "model": "smol-b",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "params": {"max_tokens": 4},
                }
            )
        )
        received = [json.loads(ws.recv(timeout=60))]
        while received[-1]["type"] not in ("done", "error"):
            received.append(json.loads(ws.recv(timeout=60)))
    assert (received[0]["type"], received[0]["node"], received[0]["engine"]) == (
        "start",
        "b",
        "eb",
    )
    assert received[-1]["type"] == "done", received[-1]
    row = wait_for(
        lambda: Usage.objects.filter(endpoint="ws.chat", model="smol-b").first(),
        timeout=30,
        what="the WebSocket chat's usage row",
    )
    assert (row.node, row.engine, row.status) == ("b", "eb", 200)


# Greedy SmolLM2 answers this until its context is full (about 10 s).
LONG = "Write the numbers from 1 to 500, separated by commas."


def slots_in_use(engine: str) -> int:
    state = EngineState.objects.get(spec__name=engine)
    return state.slots_in_use


def test_hanging_up_on_node_a_cancels_the_stream_on_node_b(cluster, orm):
    """A client of front a hangs up mid-stream: a's link closes the stream,
    b's relay hangs up on b's engine, whose slot is freed (control: busy while
    the stream was read)."""
    stream = EventStream(
        cluster.nodes["a"],
        chat("smol-b", LONG, max_tokens=2000, temperature=0),
        cluster.key,
    )
    events = stream.events()
    for _ in range(3):
        next(events)
    wait_for(lambda: slots_in_use("eb") >= 1, timeout=20, what="eb busy")
    stream.close()
    wait_for(lambda: slots_in_use("eb") == 0, timeout=20, what="eb's slot freed")


def test_replicas_share_the_load_and_a_conversation_returns_to_its_cache(cluster, orm):
    """smol has a replica on each node. First turns of several conversations
    sent at once to front a spread over both; each conversation's second
    turn, sent alone (where the least loaded rule would pick one engine for
    all), every other one to front b (which never saw the first turns: the
    fronts share what they routed through Redis), goes back to the engine
    whose prompt cache holds its first turn, and takes its prefix from that
    cache."""
    conversations = [
        [{"role": "user", "content": f"My name is {name}. Say hello to me."}]
        for name in ("Ada", "Brian", "Chloe", "Dmitri", "Emma", "Farid")
    ]

    def ask(messages, front=cluster.nodes["a"]):
        status, headers, body = http(
            f"{front.url}/v1/chat/completions",
            body={"model": "smol", "messages": messages, "max_tokens": 24},
            key=cluster.key,
        )
        assert status == 200, body
        return headers["X-Roundhouse-Engine"], body

    shared = redis.Redis.from_url(cluster.redis_url)

    def remembered() -> int:
        return sum(1 for _ in shared.scan_iter(f"{KEY_PREFIX}*"))

    before = remembered()
    with ThreadPoolExecutor(len(conversations)) as pool:
        first = list(pool.map(ask, conversations))
    assert {engine for engine, _ in first} == {"ea", "eb"}, Counter(first)
    # Front a writes what it routed after answering, off the request's path.
    wait_for(
        lambda: remembered() >= before + len(conversations),
        timeout=10,
        what="the first turns' prefixes in Redis",
    )
    for turn, (messages, (engine, body)) in enumerate(
        zip(conversations, first, strict=True)
    ):
        messages += [
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
            {"role": "user", "content": "What is my name?"},
        ]
        again, answer = ask(messages, cluster.nodes["ab"[turn % 2]])
        assert again == engine, f"turn {turn} on front {'ab'[turn % 2]}"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_node_without_the_model_files_copies_them_from_another(
    cluster, orm, tmp_path
):
    """Node f joins with an empty models directory; smol-f is placed on it
    only (label zone-f). Its supervisor copies the GGUF from a node that has
    it over the link (checked by SHA-256, shown in progress on its row), then
    loads it, and front a's request for smol-f is served by f's engine."""
    source = (
        Path(os.environ.get("ROUNDHOUSE_MODELS_DIR", ROOT / "var" / "models"))
        / cluster_setup.SMOL
    )
    models_dir = tmp_path / "f-models"
    models_dir.mkdir()
    cluster_setup.model_row("smol-f", node_labels=["zone-f"])
    try:
        f = cluster.add_node("f", labels=["zone-f"], models_dir=models_dir)
        cluster_setup.wait_resident("smol-f", {"ef"})
        assert sorted(os.listdir(models_dir)) == [cluster_setup.SMOL]  # no staging left
        copied = models_dir / cluster_setup.SMOL
        assert file_sha256(copied) == file_sha256(source)
        assert "copied model smol-f from node" in f.log()
        wait_for(
            lambda: Node.objects.get(name="f").copies == {}, what="f's copies done"
        )
        _, headers, _ = cluster_setup.routed(cluster.nodes["a"], "smol-f", cluster.key)
        assert headers["X-Roundhouse-Node"] == "f"
    finally:
        cluster.remove_node("f")
        ModelConfig.objects.filter(name="smol-f").delete()
