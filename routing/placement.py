"""Where a model's replicas live: the engines that keep it loaded.

Every reader computes placement from the same snapshot (the database's view of
nodes, engines and models), so no coordinator is needed: supervisors load the
replicas placed on their engines, fronts route to them.

The algorithm, for each model in name order, picking `replicas` engines one at
a time among the eligible ones (enabled, serving the model's format, on a node
that holds replicas: ready, or unreachable within its grace period; with every
label the model requires and none it avoids):
  1. its pin;
  2. engines that already hold it (a replica stays where it is: no churn when
     a node comes back, nor when measurements move a little);
  3. the default engine;
  4. spread: the engine on the node holding the fewest of this model's
     replicas so far;
  5. memory: an engine whose node has room for the model (its measured
     memory) before one that has not, more room first;
  6. the engine given the fewest replicas so far, then order, then name.
A model with fewer eligible engines than replicas gets what there is.

A node whose placed model's files are missing copies them from another node
(`copy_sources`: which, in what order).
"""

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from routing.select import Snapshot  # which imports this module

LABEL = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")

# Node statuses (cluster.models.NodeStatus values) as placement reads them.
HOLDING_STATUSES = frozenset({"ready", "unreachable"})
SERVING_STATUSES = frozenset({"ready"})


def label_problem(value: object) -> str | None:
    """Why `value` is not a list of labels, or None."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return "Labels are a list of strings."
    bad = [label for label in value if not LABEL.match(label)]
    if bad:
        return (
            f"Not a label: {', '.join(map(repr, bad))} (lower-case letters, digits, "
            "'-', '_' and '.', up to 63 characters)."
        )
    return None


@dataclass(frozen=True)
class NodeRoute:
    """A node as routing and placement see it."""

    name: str
    status: str
    host: str = ""
    relay_port: int = 0
    tls_fingerprint: str = ""
    labels: frozenset[str] = frozenset()
    ram_mib: float = 0.0  # 0: unknown (no memory check)
    # Models placed here whose files the node is still copying from another.
    copying: frozenset[str] = frozenset()

    @property
    def serving(self) -> bool:
        return self.status in SERVING_STATUSES

    @property
    def holding(self) -> bool:
        return self.status in HOLDING_STATUSES


@dataclass(frozen=True)
class Wanted:
    """What placement needs of a model."""

    name: str
    format: str
    replicas: int = 1
    pin: str = ""
    node_labels: frozenset[str] = frozenset()
    avoid_labels: frozenset[str] = frozenset()
    memory_mib: float = 0.0  # measured; 0: unknown


@dataclass(frozen=True)
class Holder:
    """What placement needs of an engine."""

    name: str
    node: str
    capabilities: frozenset[str]
    enabled: bool = True
    order: int = 0
    resident: frozenset[str] = frozenset()
    memory_mib: float = 0.0


def eligible(model: Wanted, engine: Holder, nodes: Mapping[str, NodeRoute]) -> bool:
    """Whether a replica of `model` may be placed on `engine`."""
    if not engine.enabled or model.format not in engine.capabilities:
        return False
    if not engine.node:  # an engine of a one-host platform: no node, no labels
        return not model.node_labels
    node = nodes.get(engine.node)
    if node is None or not node.holding:
        return False
    return labels_allow(model.node_labels, model.avoid_labels, node.labels)


def labels_allow(
    required: frozenset[str], avoided: frozenset[str], labels: frozenset[str]
) -> bool:
    """Whether a node with `labels` may hold a model that requires and avoids
    these."""
    return required <= labels and not (avoided & labels)


def place(
    models: Iterable[Wanted],
    engines: Mapping[str, Holder],
    nodes: Mapping[str, NodeRoute],
    *,
    default_engine: str = "",
) -> dict[str, tuple[str, ...]]:
    """Model name -> the engines of its replicas, best first (see above)."""
    placed_on: dict[str, int] = {name: 0 for name in engines}
    used_mib: dict[str, float] = {}
    for engine in engines.values():
        used_mib[engine.node] = used_mib.get(engine.node, 0.0) + engine.memory_mib
    placement: dict[str, tuple[str, ...]] = {}
    for model in sorted(models, key=lambda m: m.name):
        candidates = [e for e in engines.values() if eligible(model, e, nodes)]
        chosen: list[Holder] = []
        per_node: dict[str, int] = {}
        while candidates and len(chosen) < max(model.replicas, 1):
            best = min(
                candidates,
                key=lambda engine: _preference(
                    engine,
                    model,
                    default_engine=default_engine,
                    on_node=per_node.get(engine.node, 0),  # noqa: B023 - used at once
                    room=_room(engine, model, nodes, used_mib),  # noqa: B023
                    placed=placed_on[engine.name],
                ),
            )
            candidates.remove(best)
            chosen.append(best)
            per_node[best.node] = per_node.get(best.node, 0) + 1
            placed_on[best.name] += 1
            if model.name not in best.resident:
                used_mib[best.node] = used_mib.get(best.node, 0.0) + model.memory_mib
        placement[model.name] = tuple(engine.name for engine in chosen)
    return placement


def _preference(
    engine: Holder,
    model: Wanted,
    *,
    default_engine: str,
    on_node: int,
    room: float | None,
    placed: int,
) -> tuple:
    """The sort key of rules 1-6 (smallest first)."""
    return (
        engine.name != model.pin,
        model.name not in engine.resident,
        engine.name != default_engine,
        on_node,
        room is not None and room < 0,
        -(room or 0.0),
        placed,
        engine.order,
        engine.name,
    )


def _room(
    engine: Holder,
    model: Wanted,
    nodes: Mapping[str, NodeRoute],
    used_mib: Mapping[str, float],
) -> float | None:
    """Memory left on the engine's node once the model is there (MiB); None
    when the node's memory is unknown."""
    node = nodes.get(engine.node)
    if node is None or not node.ram_mib:
        return None
    needed = 0.0 if model.name in engine.resident else model.memory_mib
    return node.ram_mib - used_mib.get(engine.node, 0.0) - needed


def copy_sources(snapshot: "Snapshot", model: str, here: str) -> list[NodeRoute]:
    """The nodes to copy `model`'s files from to node `here`, best first: the
    other serving nodes that can be reached (they have an address), those
    holding the model resident first (its files are there for sure), then by
    name."""
    holders = {
        engine.node for engine in snapshot.engines.values() if model in engine.resident
    }
    others = [
        node
        for node in snapshot.nodes.values()
        if node.serving and node.name != here and node.host
    ]
    return sorted(others, key=lambda node: (node.name not in holders, node.name))
