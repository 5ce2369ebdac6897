"""Where a pull runs on a cluster when its caller names no node: on the node
of the engine that holds (or would hold) the model's first replica, so the
weights land where they are served first and the other nodes copy them from
there. One choice for the three ways a pull starts (`manage.py pull`, the
admin's Add from Hugging Face page, POST /v1/pulls), each handing
`pull_node_default` to catalog.pull_jobs.pull_start, which asks it once the
plan says what the model is.

A model of the catalog already placed: its first placed engine's node. A
new one: placement (routing.placement) run on the fleet as it is now with the
model added (its format, and the memory its plan says it needs), and its
first engine's node. Only a node that is ready takes the pull: a placed
engine on a node that is not goes to the next placed one. A first replica on
this host's engine (no node: the default engine, say) leaves the pull to any
worker, as this host has no pull queue of its own. On a platform of one host
(no nodes joined) nothing is chosen: the first worker takes it."""

from dataclasses import dataclass, replace

from catalog.pull import PullPlan
from cluster.models import Node
from routing.select import ModelRoute, Snapshot

READY = "ready"


@dataclass(frozen=True)
class PullNode:
    """The node a pull runs on ("" for the first worker that takes it), and
    why, as the pull's row and its caller say it."""

    node: str
    reason: str


def cluster_joined() -> bool:
    """Whether the platform is a cluster: a node joined and not revoked."""
    return Node.objects.filter(
        joined_at__isnull=False, revoked_at__isnull=True
    ).exists()


def pull_node(*, name: str, model_format: str, needs_mib: float) -> PullNode:
    """Where a pull of the model `name` (of `model_format`, needing
    `needs_mib` served) runs when no node is asked for (see above)."""
    if not cluster_joined():
        return PullNode(node="", reason="")
    # Imported here: the fleet's selectors bring the engines' clients (and
    # numpy), which a pull on one host (manage.py pull's start) does without.
    from .selectors import routing_snapshot

    snapshot = routing_snapshot()
    placed = snapshot.placed(name)
    first = "its first replica is placed"
    if not placed:
        placed = _with_model(snapshot, name, model_format, needs_mib).placed(name)
        first = "its first replica would be placed"
    if not placed:
        return PullNode(
            node="",
            reason="any worker: no engine serves its format where it may be placed",
        )
    for rank, engine in enumerate(placed):
        node = snapshot.engines[engine].node
        if not node:
            return PullNode(
                node="",
                reason=f"any worker: {first} on this host's engine {engine}, "
                "and this host has no pull queue of its own",
            )
        status = snapshot.nodes[node].status if node in snapshot.nodes else ""
        if status == READY:
            if rank == 0:
                return PullNode(
                    node=node, reason=f"node {node}: where {first} ({engine})"
                )
            first_node = snapshot.engines[placed[0]].node
            return PullNode(
                node=node,
                reason=f"node {node}: where a replica is placed ({engine}); "
                f"node {first_node}, of its first, is not ready",
            )
    return PullNode(
        node="", reason="any worker: no node its replicas are placed on is ready"
    )


def pull_node_default(plan: PullPlan) -> tuple[str, str]:
    """pull_node for a planned pull, as pull_start's `node_default`."""
    chosen = pull_node(
        name=plan.name, model_format=plan.format, needs_mib=plan.needs_mib
    )
    return chosen.node, chosen.reason


def _with_model(
    snapshot: Snapshot, name: str, model_format: str, needs_mib: float
) -> Snapshot:
    """The snapshot with the model added as a pull would add it: one
    replica, no pin nor labels, its estimated need as its memory."""
    added = ModelRoute(name=name, format=model_format, memory_mib=needs_mib)
    return replace(snapshot, models={**snapshot.models, name: added})
