"""Where a pull runs when no node is asked for (fleet/pull_node.py): nowhere
in particular on one host; on a cluster, the node of the engine that holds
the model's first replica, or would once pulled (placement run with the model
added, its memory the plan's need); a node asked for wins. The admin's Pull
button and `manage.py pull` take the same default and say it. Pulls planned
against the local hub (tests/hub.py) as in test_pull_jobs.py."""

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.db import connections
from django.utils import timezone

from catalog.models import ModelConfig, ModelPull, PullStatus
from catalog.pull_jobs import pull_run, pull_start
from cluster.models import Node
from fleet.models import EngineSpec
from fleet.pull_node import PullNode, pull_node, pull_node_default
from tests.factories import EngineSpecFactory, ModelConfigFactory
from tests.hub import LocalHub
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

REPO = "org/SmolLM2-135M-GGUF"
FILE = "smol.Q4_1.gguf"
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
GIB_MIB = 1024


@pytest.fixture
def hub(monkeypatch, settings, tmp_path):
    smol = Path(settings.MODELS_DIR) / SMOL
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub({REPO: {FILE: smol}}) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


def ready_node(name: str, *, ram_mib: float = 0.0, engine_order: int = 0) -> Node:
    """A joined node beating now, with `ram_mib` of RAM (0: not reported)
    and a CPU engine serving GGUF, `cpu-<name>`."""
    now = timezone.now()
    node = Node.objects.create(
        name=name,
        address=f"10.0.0.{ord(name[0]) % 250}",
        joined_at=now,
        last_heartbeat=now,
        hardware={"ram_mib": ram_mib} if ram_mib else {},
    )
    EngineSpecFactory(
        name=f"cpu-{name}", capabilities=["gguf"], node=node, order=engine_order
    )
    return node


@pytest.fixture
def cluster_only():
    """This host's seeded engine (cpu0, the default engine) disabled: the
    cluster's nodes hold the replicas."""
    EngineSpec.objects.filter(node=None).update(enabled=False)


def test_one_host_chooses_no_node():
    """No node joined (this host's default engine, a node only invited): no
    node, no reason. Control: once the node joined, the choice is made and
    said: this host's default engine takes the first replica, so any worker
    (this host has no queue of its own); with that engine disabled, the
    node."""
    invited = Node.objects.create(name="a", address="10.0.0.1")
    EngineSpecFactory(name="cpu-a", capabilities=["gguf"], node=invited, order=0)
    assert pull_node(name="smol", model_format="gguf", needs_mib=100) == PullNode(
        node="", reason=""
    )
    now = timezone.now()
    Node.objects.filter(pk=invited.pk).update(joined_at=now, last_heartbeat=now)
    assert pull_node(name="smol", model_format="gguf", needs_mib=100) == PullNode(
        node="",
        reason="any worker: its first replica would be placed on this host's "
        "engine cpu0, and this host has no pull queue of its own",
    )
    EngineSpec.objects.filter(name="cpu0").update(enabled=False)
    assert pull_node(name="smol", model_format="gguf", needs_mib=100).node == "a"


def test_a_placed_model_is_pulled_where_its_first_replica_is(cluster_only):
    """A model of the catalog pinned to b's engine: b, though a's engine
    comes first and has more room. Control: a new model goes to a."""
    ready_node("a", ram_mib=64 * GIB_MIB, engine_order=0)
    ready_node("b", ram_mib=8 * GIB_MIB, engine_order=1)
    ModelConfigFactory(name="pinned", engine_pin="cpu-b")
    assert pull_node(name="pinned", model_format="gguf", needs_mib=100) == PullNode(
        node="b", reason="node b: where its first replica is placed (cpu-b)"
    )
    assert pull_node(name="new", model_format="gguf", needs_mib=100) == PullNode(
        node="a", reason="node a: where its first replica would be placed (cpu-a)"
    )


def test_a_first_replica_on_a_node_not_ready_leaves_it_to_the_next(cluster_only):
    """Two replicas, the first pinned to a, which stopped beating 10 s ago
    (unreachable: it keeps its replicas for the grace period, but takes no
    work): the node of the second, b, and the reason says why. Control: a
    beating again, a."""
    ready_node("a")
    ready_node("b")
    ModelConfigFactory(name="two", engine_pin="cpu-a", replicas=2)
    Node.objects.filter(name="a").update(
        last_heartbeat=timezone.now() - timedelta(seconds=10)
    )
    assert pull_node(name="two", model_format="gguf", needs_mib=100) == PullNode(
        node="b",
        reason="node b: where a replica is placed (cpu-b); node a, of its first, "
        "is not ready",
    )
    Node.objects.filter(name="a").update(last_heartbeat=timezone.now())
    assert pull_node(name="two", model_format="gguf", needs_mib=100).node == "a"


def test_a_new_model_goes_where_placement_would_put_it(cluster_only):
    """Placement with the model added: the node with the most room once it
    is there (b), though a's engine comes first in order; an engine that
    does not serve the format is not a place. Control: with a given more
    room than b, a."""
    ready_node("a", ram_mib=4 * GIB_MIB, engine_order=0)
    ready_node("b", ram_mib=16 * GIB_MIB, engine_order=1)
    c = ready_node("c", ram_mib=64 * GIB_MIB)
    c.engines.update(capabilities=["transformers"])
    assert pull_node(name="new", model_format="gguf", needs_mib=2 * GIB_MIB) == (
        PullNode(
            node="b", reason="node b: where its first replica would be placed (cpu-b)"
        )
    )
    Node.objects.filter(name="a").update(hardware={"ram_mib": 32 * GIB_MIB})
    assert pull_node(name="new", model_format="gguf", needs_mib=2 * GIB_MIB).node == (
        "a"
    )


def test_a_new_model_that_fits_nowhere_known_goes_where_memory_is_unknown(
    cluster_only,
):
    """Its need counts: 1 GiB fits in b's 4 GiB, which placement prefers to
    a node whose memory is not known (a); 8 GiB does not, so a."""
    ready_node("a", engine_order=0)
    ready_node("b", ram_mib=4 * GIB_MIB, engine_order=1)
    assert pull_node(name="new", model_format="gguf", needs_mib=GIB_MIB).node == "b"
    assert pull_node(name="new", model_format="gguf", needs_mib=8 * GIB_MIB).node == (
        "a"
    )


def test_no_ready_node_for_it_leaves_it_to_any_worker(cluster_only):
    """Its only engine is on a node that stopped beating long ago: no node,
    and the reason says why. Control: the node beating again, it."""
    node = ready_node("a")
    Node.objects.filter(pk=node.pk).update(
        last_heartbeat=timezone.now() - timedelta(days=1)
    )
    assert pull_node(name="new", model_format="gguf", needs_mib=100) == PullNode(
        node="", reason="any worker: no engine serves its format where it may be placed"
    )
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now())
    assert pull_node(name="new", model_format="gguf", needs_mib=100).node == "a"


def test_a_pull_started_without_a_node_runs_on_the_chosen_one(hub, cluster_only):
    """pull_start with the fleet's default: the row names the node and why
    (the plan's name, format and need placed); a node asked for wins, with
    no reason given."""
    ready_node("a", ram_mib=4 * GIB_MIB, engine_order=0)
    ready_node("b", ram_mib=16 * GIB_MIB, engine_order=1)
    chosen = pull_start(
        source=f"hf:{REPO}:Q4_1", name="smol", node_default=pull_node_default
    )
    assert (chosen.node, chosen.node_reason) == (
        "b",
        "node b: where its first replica would be placed (cpu-b)",
    )
    asked = pull_start(
        source=f"hf:{REPO}:Q4_1",
        name="smol-a",
        node="a",
        node_default=pull_node_default,
    )
    assert (asked.node, asked.node_reason) == ("a", "")
    assert ModelPull.objects.count() == 2


def two_nodes() -> None:
    """a (4 GiB of RAM) and b (16 GiB), each with a GGUF engine: a new
    model's first replica would be placed on b, the roomier."""
    ready_node("a", ram_mib=4 * GIB_MIB, engine_order=0)
    ready_node("b", ram_mib=16 * GIB_MIB, engine_order=1)


def test_the_admin_pull_button_takes_the_default_and_says_it(
    admin_client, hub, cluster_only
):
    """The node field offers the default first; left empty, the pull runs
    on b and the message says why. Control: a node picked wins, no reason."""
    two_nodes()
    page = "/admin/catalog/modelconfig/add-from-hub/"
    form = {"repo": REPO, "file": FILE, "commit": "main", "name": "smol"}
    shown = admin_client.get(page, {"repo": REPO}).content.decode()
    assert '<option value="" selected>where its first replica is placed' in shown
    answer = admin_client.post(page, {**form, "node": ""}, follow=True)
    said = [m.message for m in get_messages(answer.wsgi_request)]
    [message] = said
    assert message.startswith("Pulling smol: ") and message.endswith(
        " MiB to download, on node b: where its first replica would be placed (cpu-b)."
    )
    assert ModelPull.objects.get(name="smol").node == "b"
    admin_client.post(page, {**form, "name": "smol-a", "node": "a"})
    picked = ModelPull.objects.get(name="smol-a")
    assert (picked.node, picked.node_reason) == ("a", "")


@pytest.mark.django_db(transaction=True)
def test_the_command_on_a_cluster_pulls_where_it_is_placed(
    hub, cluster_only, capsys, monkeypatch
):
    """`manage.py pull` without --node on a cluster: a job on b, said, and
    followed to its end (run here as b's worker would). Control: the model
    is added, by the job."""
    two_nodes()

    def worker() -> None:
        try:
            pull = wait_for(
                lambda: ModelPull.objects.filter(name="smol").first(),
                what="the pull queued by the command",
            )
            pull_run(pull.pk)
        finally:
            connections.close_all()

    running = threading.Thread(target=worker)
    running.start()
    try:
        call_command("pull", f"hf:{REPO}:Q4_1", "--name", "smol")
    finally:
        running.join(timeout=120)
    out = capsys.readouterr().out
    assert "pulling on node b: where its first replica would be placed (cpu-b)" in out
    pull = ModelPull.objects.get(name="smol")
    assert (pull.node, pull.status) == ("b", PullStatus.DONE)
    assert pull.model == ModelConfig.objects.get(name="smol")
