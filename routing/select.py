"""Choosing the engine that serves a request, from a snapshot of the fleet.

Only enabled engines that are up and whose capabilities (from the one table in
`routing.compat`) include the model's format are candidates. The first rule
that yields a candidate wins:

1. pin: the engine the model is pinned to;
2. resident: an engine that already holds the model: the one whose prompt
   cache holds the conversation's prefix (`affinity`, rule "affinity") unless
   it is more than AFFINITY_SLACK requests busier than the least loaded; else
   the least loaded of them (replicas are balanced here);
3. placed: an engine a replica is placed on (routing.placement) that is
   still loading it, the least loaded; not one whose node is still copying
   the model's files (when every placed one is, NoEngine says so);
4. default: the default engine from server settings;
5. least-loaded: the candidate with the lowest queue depth + slots in use,
   cooling engines last, ties to the model's owner, then engine order, then name.
Load is what the snapshot recorded or, when higher, what this front has in
flight there now (`in_flight`): the snapshot is up to a second old, and a
burst would otherwise all go to the engine that was idle then.

A pin that cannot be honoured is logged once per (model, engine) per Router,
then the next rule applies. No candidate at all raises `NoEngine`, whose message
says whether no engine serves the format or every one that does is down.
Owners (`assign_owners`): pin if valid, else default if compatible; the rest, in
name order, go to the compatible engine owning the fewest models so far. Owners
ignore up/down, so they stay put while an engine restarts.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from routing import compat
from routing.placement import Holder, NodeRoute, Wanted, labels_allow, place

Rule = Literal["pin", "affinity", "resident", "placed", "default", "least-loaded"]

# The engine holding a conversation's prefix is chosen while it has at most
# this many more requests than the least loaded replica: reading the prefix
# again elsewhere costs less than waiting behind that many.
AFFINITY_SLACK = 2

LOGGER_NAME = "roundhouse.routing"

# The engine states (as the supervisor records them) in which an engine takes
# requests. A loading engine serves too: it bound its port first, and a request
# for a model still loading waits in the engine's own queue; a cooling one
# queues work until it cools. Starting, stopping (draining), unhealthy (its
# decode loop died or is stuck: being replaced), crashed and stopped do not.
SERVING_STATES = frozenset({"ready", "loading", "cooling"})


@dataclass(frozen=True)
class EngineStatus:
    """One engine as routing sees it: its capabilities, liveness and load."""

    name: str
    backend: str
    # From compat.capabilities_for(backend, spec override).
    capabilities: frozenset[str]
    # The process is running and has reported ready.
    up: bool
    enabled: bool = True
    order: int = 0
    resident: frozenset[str] = frozenset()
    queue_depth: int = 0
    slots_in_use: int = 0
    cooling: bool = False
    node: str = ""  # "" on a one-host platform
    memory_mib: float = 0.0
    # Which start of the engine process this is (its start, as recorded): a
    # restarted engine's caches hold nothing of what the last one served.
    incarnation: str = ""

    @property
    def load(self) -> int:
        """Requests waiting plus requests running."""
        return self.queue_depth + self.slots_in_use

    def serves(self, model_format: str) -> bool:
        """Whether this engine is enabled and its capabilities include the format."""
        return self.enabled and model_format in self.capabilities

    def usable_for(self, model_format: str) -> bool:
        """Whether a request for this format may be routed here now."""
        return self.up and self.serves(model_format)

    def view(self) -> compat.EngineView:
        """The compat view of this engine, for `compat.pin_problem`."""
        return compat.EngineView(
            name=self.name,
            backend=self.backend,
            capabilities=self.capabilities,
            enabled=self.enabled,
        )


@dataclass(frozen=True)
class ModelRoute:
    """What routing needs to know of a configured model."""

    name: str
    format: str
    pin: str = ""
    task: str = ""  # chat, completion or embedding: which endpoints may use it
    created: int = 0  # when it was configured (Unix time), for model listings
    replicas: int = 1
    node_labels: frozenset[str] = frozenset()
    avoid_labels: frozenset[str] = frozenset()
    memory_mib: float = 0.0  # measured; 0: unknown
    # Callers (keys, users) share one another's prompt cache and its affinity;
    # False: each has its own scope (platform/api/choices.py).
    share_prompt_cache: bool = False


@dataclass(frozen=True)
class Snapshot:
    """The fleet and the model configs at one moment; routing reads nothing else."""

    engines: Mapping[str, EngineStatus]
    models: Mapping[str, ModelRoute]
    default_engine: str = ""
    taken_at: float = 0.0
    nodes: Mapping[str, NodeRoute] = field(default_factory=dict)

    def owners(self) -> dict[str, str]:
        """Model name -> owner engine name, computed once per snapshot."""
        return dict(self._owners)

    def owner_of(self, model_name: str) -> str | None:
        """The engine that owns the model, or None when it has none."""
        return self._owners.get(model_name)

    @cached_property
    def _owners(self) -> Mapping[str, str]:
        # cached_property writes the instance __dict__ directly, so it works on a
        # frozen dataclass; a race between threads only computes the same value twice.
        return assign_owners(self.models.values(), self.engines, self.default_engine)

    def placed(self, model_name: str) -> tuple[str, ...]:
        """The engines a model's replicas are placed on, best first."""
        return self._placement.get(model_name, ())

    @cached_property
    def _placement(self) -> Mapping[str, tuple[str, ...]]:
        models = [
            Wanted(
                name=m.name,
                format=m.format,
                replicas=m.replicas,
                pin=m.pin,
                node_labels=m.node_labels,
                avoid_labels=m.avoid_labels,
                memory_mib=m.memory_mib,
            )
            for m in self.models.values()
        ]
        engines = {
            e.name: Holder(
                name=e.name,
                node=e.node,
                capabilities=e.capabilities,
                enabled=e.enabled,
                order=e.order,
                resident=e.resident,
                memory_mib=e.memory_mib,
            )
            for e in self.engines.values()
        }
        return place(models, engines, self.nodes, default_engine=self.default_engine)

    @cached_property
    def engine_views(self) -> Mapping[str, compat.EngineView]:
        """The engines as compat views, for `compat.pin_problem`."""
        return {name: engine.view() for name, engine in self.engines.items()}


@dataclass(frozen=True)
class Choice:
    """The engine chosen for a request and the rule that chose it."""

    engine: str
    rule: Rule


class NoEngine(Exception):
    """No engine can serve the model now; `message` is fit to show a user."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def assign_owners(
    models: Iterable[ModelRoute],
    engines: Mapping[str, EngineStatus],
    default_engine: str,
) -> dict[str, str]:
    """Give each model one owner engine: pin, else default, else the least owning."""
    ordered = sorted(models, key=lambda model: model.name)
    views = {name: engine.view() for name, engine in engines.items()}
    default = engines.get(default_engine)
    owners: dict[str, str] = {}
    unplaced: list[ModelRoute] = []
    # Pins and the default first, so the balancing below counts every model they
    # own, not only those whose names sort earlier.
    for model in ordered:
        if model.pin and (
            compat.pin_problem(pin=model.pin, model_format=model.format, engines=views)
            is None
        ):
            owners[model.name] = model.pin
        elif default is not None and default.serves(model.format):
            owners[model.name] = default.name
        else:
            unplaced.append(model)
    owned = {name: 0 for name in engines}
    for owner in owners.values():
        owned[owner] += 1
    for model in unplaced:
        compatible = [e for e in engines.values() if e.serves(model.format)]
        if not compatible:
            continue
        least = min(compatible, key=lambda e: (owned[e.name], e.order, e.name))
        owners[model.name] = least.name
        owned[least.name] += 1
    return owners


class Router:
    """Chooses an engine for each request; remembers which bad pins it reported."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        self._reported: set[tuple[str, str]] = set()
        self._reported_lock = threading.Lock()

    def choose(
        self,
        model: ModelRoute,
        snapshot: Snapshot,
        *,
        affinity: str = "",
        in_flight: Mapping[str, int] | None = None,
    ) -> Choice:
        """The engine that serves `model` now, by pin, residency (and the
        prompt cache's affinity), placement, default or load."""
        engines = snapshot.engines
        fmt = model.format
        if model.pin:
            if self._pin_usable(model, snapshot):
                return Choice(model.pin, "pin")
        load = _load_with(in_flight or {})
        # Only engines on nodes with the labels the model requires and none it
        # avoids, whatever the rule.
        allowed = {
            name: engine
            for name, engine in engines.items()
            if engine.usable_for(fmt) and labels_fit(model, engine, snapshot.nodes)
        }
        resident = [e for e in allowed.values() if model.name in e.resident]
        owner = snapshot.owner_of(model.name)
        if resident:
            least = self._least_loaded(resident, owner, load)
            held = engines.get(affinity)
            if (
                held is not None
                and held in resident
                and not held.cooling
                and load(held) <= load(least) + AFFINITY_SLACK
            ):
                return Choice(held.name, "affinity")
            return Choice(least.name, "resident")
        placed = [
            allowed[name] for name in snapshot.placed(model.name) if name in allowed
        ]
        ready = [e for e in placed if not _copying(model, e, snapshot.nodes)]
        if ready:
            return Choice(self._least_loaded(ready, owner, load).name, "placed")
        if placed:
            nodes = ", ".join(sorted({engine.node for engine in placed}))
            raise NoEngine(
                f"{model.name}'s files are being copied to node {nodes}: it is "
                "served once they are there"
            )
        if snapshot.default_engine in allowed:
            return Choice(snapshot.default_engine, "default")
        candidates = list(allowed.values())
        if candidates:
            least = self._least_loaded(candidates, owner, load)
            return Choice(least.name, "least-loaded")
        if any(engine.usable_for(fmt) for engine in engines.values()):
            raise NoEngine(_no_fitting_node_message(model))
        raise NoEngine(_no_engine_message(fmt, engines))

    def _pin_usable(self, model: ModelRoute, snapshot: Snapshot) -> bool:
        pair = (model.name, model.pin)
        problem = compat.pin_problem(
            pin=model.pin, model_format=model.format, engines=snapshot.engine_views
        )
        if problem is None and not snapshot.engines[model.pin].up:
            problem = f"engine {model.pin!r} is down"
        if problem is None:
            # Forget a pin that works again, so a later failure is reported anew.
            if pair in self._reported:
                with self._reported_lock:
                    self._reported.discard(pair)
            return True
        with self._reported_lock:
            if pair in self._reported:
                return False
            self._reported.add(pair)
        self.logger.warning(
            "model %r: pin ignored, %s; routing it by the next rule",
            model.name,
            problem,
        )
        return False

    @staticmethod
    def _least_loaded(
        engines: Iterable[EngineStatus],
        owner: str | None,
        load: Callable[[EngineStatus], int] = lambda e: e.load,
    ) -> EngineStatus:
        # A cooling engine holds new decode steps, so any warm engine beats it.
        return min(
            engines,
            key=lambda e: (e.cooling, load(e), e.name != owner, e.order, e.name),
        )


def labels_fit(
    model: ModelRoute, engine: EngineStatus, nodes: Mapping[str, NodeRoute]
) -> bool:
    """Whether the engine's node has every label the model requires and none
    it avoids (an engine of no node has no labels)."""
    if not (model.node_labels or model.avoid_labels):
        return True
    node = nodes.get(engine.node)
    labels = node.labels if node is not None else frozenset()
    return labels_allow(model.node_labels, model.avoid_labels, labels)


def _copying(
    model: ModelRoute, engine: EngineStatus, nodes: Mapping[str, NodeRoute]
) -> bool:
    """Whether the engine's node is still copying the model's files."""
    node = nodes.get(engine.node)
    return node is not None and model.name in node.copying


def _load_with(in_flight: Mapping[str, int]) -> Callable[[EngineStatus], int]:
    """An engine's load: as recorded, or this front's requests in flight there
    when more."""
    return lambda engine: max(engine.load, in_flight.get(engine.name, 0))


def _no_fitting_node_message(model: ModelRoute) -> str:
    wants = []
    if model.node_labels:
        wants.append(f"labelled {', '.join(sorted(model.node_labels))}")
    if model.avoid_labels:
        wants.append(f"not labelled {', '.join(sorted(model.avoid_labels))}")
    return (
        f"no engine that can serve {model.name} is running on a node "
        f"{' and '.join(wants)}"
    )


def _no_engine_message(model_format: str, engines: Mapping[str, EngineStatus]) -> str:
    serving = sorted(name for name, e in engines.items() if e.serves(model_format))
    if serving:
        down = ", ".join(serving)
        verb = "is" if len(serving) == 1 else "are"
        return f"no engine that serves {model_format} is running: {down} {verb} down"
    disabled = sorted(
        name
        for name, e in engines.items()
        if not e.enabled and model_format in e.capabilities
    )
    if disabled:
        names = ", ".join(disabled)
        verb = "is" if len(disabled) == 1 else "are"
        return (
            f"no engine can serve {model_format} models ({names} {verb} disabled); "
            "enable or configure one in the admin"
        )
    return f"no engine can serve {model_format} models; configure one in the admin"


class SnapshotCache:
    """Holds the latest snapshot and reloads it when older than `max_age_s`."""

    def __init__(
        self,
        loader: Callable[[], Snapshot],
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._loader = loader
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        # One attribute holding (snapshot, loaded_at), so the lock-free read below
        # never sees a snapshot paired with another snapshot's time.
        self._cached: tuple[Snapshot, float] | None = None
        # invalidate() was called since the last load: not fresh, however
        # young (the snapshot is kept: while the database is down, it is all
        # there is).
        self.invalidated = False

    def peek(self) -> tuple[Snapshot, float] | None:
        """The cached snapshot, however old, with its age in seconds; never loads
        (an event loop can call it without leaving its thread)."""
        cached = self._cached
        if cached is None:
            return None
        return cached[0], self._clock() - cached[1]

    def fresh(self) -> Snapshot | None:
        """The cached snapshot if younger than max_age_s and not invalidated,
        else None; never loads."""
        peeked = self.peek()
        if peeked is not None and peeked[1] < self._max_age_s and not self.invalidated:
            return peeked[0]
        return None

    def get(self) -> Snapshot:
        """The cached snapshot if younger than max_age_s, else a freshly loaded one."""
        fresh = self.fresh()
        if fresh is not None:
            return fresh
        with self._lock:
            # Callers that waited on the lock find the snapshot the first one loaded.
            fresh = self.fresh()
            if fresh is not None:
                return fresh
            # Age counts from before the load: the data is at least that old.
            started = self._clock()
            snapshot = self._loader()
            self._cached = (snapshot, started)
            self.invalidated = False
            return snapshot

    def clear(self) -> None:
        """Forget the snapshot (a process that never read one)."""
        with self._lock:
            self._cached = None

    def invalidate(self) -> None:
        """Make the next `get` load a fresh snapshot (`peek` still shows the
        last one)."""
        self.invalidated = True
