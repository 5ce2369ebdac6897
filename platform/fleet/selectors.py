"""Reads of fleet data: engines as routing sees them, ports, effective limits,
and the configuration each engine should run (built as engines/launch/config.py's typed
schema, which the engine reads back)."""

import json
import time
from dataclasses import dataclass

from django.db.models.functions import Now

from catalog.models import ModelConfig
from catalog.selectors import models_servable_by
from cluster.selectors import NodeView, nodes_now
from engines.launch.config import (
    EngineConfig,
    Limits,
    ModelSpec,
    Thresholds,
    VendorThresholds,
)
from routing import select as routes
from routing.compat import EngineView
from routing.placement import NodeRoute

from .models import (
    ConcurrencySettings,
    EngineSpec,
    EngineState,
    EngineStatus,
    ServerSettings,
    ThermalSettings,
)


def engine_views() -> dict[str, EngineView]:
    """Every configured engine, keyed by name, as routing sees it."""
    return {spec.name: spec.as_view() for spec in EngineSpec.objects.all()}


def engine_port(*, spec: EngineSpec, server: ServerSettings | None = None) -> int:
    """The spec's fixed port, else the server's base port + the spec's order."""
    if spec.port:
        return spec.port
    server = server or ServerSettings.load()
    return spec.port_with(server.base_port)


@dataclass(frozen=True)
class EngineLimits:
    """Concurrency limits in force for one engine, overrides applied."""

    max_parallel_requests: int
    max_slots_per_model: int
    kv_cache_mib: int


def engine_limits(*, spec: EngineSpec) -> EngineLimits:
    """The default limits with this engine's override, where set, on top."""
    defaults = ConcurrencySettings.load()
    override = defaults.overrides.filter(engine=spec).first()
    return EngineLimits(
        max_parallel_requests=(override and override.max_parallel_requests)
        or defaults.max_parallel_requests,
        max_slots_per_model=(override and override.max_slots_per_model)
        or defaults.max_slots_per_model,
        kv_cache_mib=(override and override.kv_cache_mib) or defaults.kv_cache_mib,
    )


@dataclass(frozen=True)
class DesiredEngine:
    """An enabled spec as the supervisor should run it."""

    spec_id: int
    name: str
    order: int
    env: dict[str, str]
    devices: str
    restart_requested_at: object
    config: EngineConfig

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def spawn_key(self) -> str:
        """What forces a restart when it changes (unlike limits, pushed live)."""
        return json.dumps(
            [
                self.name,
                self.config.port,
                self.config.backend,
                self.env,
                self.devices,
                self.config.cpus,  # applied when the process starts
            ],
            sort_keys=True,
        )

    @property
    def config_key(self) -> str:
        return self.config.to_json()


def thermal_thresholds() -> Thresholds:
    """ThermalSettings and its per-vendor overrides, as engines read them."""
    settings = ThermalSettings.load()
    return Thresholds(
        cpu_high=settings.cpu_high,
        cpu_resume=settings.cpu_resume,
        gpu_high=settings.gpu_high,
        gpu_resume=settings.gpu_resume,
        overrides={
            row.vendor: VendorThresholds(high=row.high, resume=row.resume)
            for row in settings.overrides.all()
        },
    )


def engine_config(
    *,
    spec: EngineSpec,
    server: ServerSettings,
    thermal: Thresholds,
    placed: frozenset[str] = frozenset(),
) -> EngineConfig:
    """The typed configuration one engine starts with and is pushed live.
    `placed`: the models whose replicas are placed on this engine (a
    cluster's routing.placement), kept loaded there: their keep-alive does not
    apply on this engine (it still does where a model is loaded outside its
    placement), so the supervisor's loading of placed replicas and the idle
    unload never undo each other."""
    limits = engine_limits(spec=spec)
    models = [
        ModelSpec.from_dict(item)
        for item in models_servable_by(capabilities=spec.effective_capabilities)
    ]
    models = [
        model.model_copy(update={"keep_alive_s": 0}) if model.name in placed else model
        for model in models
    ]
    return EngineConfig(
        name=spec.name,
        port=engine_port(spec=spec, server=server),
        backend=spec.backend,
        limits=Limits(
            max_parallel_requests=limits.max_parallel_requests,
            max_slots_per_model=limits.max_slots_per_model,
            kv_cache_mib=limits.kv_cache_mib,
            queue_limit=server.queue_limit,
            queue_timeout_s=server.queue_timeout_s,
            models_max=server.models_max,
            memory_margin_mib=server.memory_margin_mib,
            stuck_after_s=server.stuck_after_s,
        ),
        models={model.name: model for model in models},
        thermal=thermal,
        devices=spec.device_list,
        cpus=spec.cpu_list,
    )


def engines_desired(*, node: str | None = None) -> list[DesiredEngine]:
    """Every enabled engine of `node` (None: the engines of no node, on a
    one-host platform) with the configuration it should be running: on a
    node, the replicas placed on an engine are kept loaded there
    (engine_config's `placed`)."""
    server = ServerSettings.load()
    thermal = thermal_thresholds()
    specs = EngineSpec.objects.filter(enabled=True)
    specs = (
        specs.filter(node__isnull=True)
        if node is None
        else specs.filter(node__name=node)
    )
    placed = {} if node is None else models_placed_on(node=node)
    return [
        DesiredEngine(
            spec_id=spec.pk,
            name=spec.name,
            order=spec.order,
            env=dict(spec.env),
            devices=spec.devices,
            restart_requested_at=spec.restart_requested_at,
            config=engine_config(
                spec=spec,
                server=server,
                thermal=thermal,
                placed=placed.get(spec.name, frozenset()),
            ),
        )
        for spec in specs.order_by("order", "name")
    ]


def models_placed_on(*, node: str) -> dict[str, frozenset[str]]:
    """Engine name -> the models whose replicas are placed on it, for the
    engines of `node` (routing.placement, from one read of the fleet)."""
    snapshot = routing_snapshot()
    placed: dict[str, set[str]] = {}
    for model in snapshot.models:
        for engine in snapshot.placed(model):
            if snapshot.engines[engine].node == node:
                placed.setdefault(engine, set()).add(model)
    return {engine: frozenset(models) for engine, models in placed.items()}


def engine_specs_on_nodes_only() -> dict[str, list[str]]:
    """The enabled engine specs by node name, when every enabled spec belongs
    to a node ({} when one does not, or none is enabled): then a plain
    supervisor (no --node) runs no engine at all."""
    specs = list(
        EngineSpec.objects.filter(enabled=True)
        .order_by("order", "name")
        .values_list("name", "node__name")
    )
    if not specs or any(node is None for _, node in specs):
        return {}
    by_node: dict[str, list[str]] = {}
    for name, node in specs:
        by_node.setdefault(node, []).append(name)
    return dict(sorted(by_node.items()))


# An engine whose state the supervisor has not refreshed for this long is taken
# for down (the supervisor polls every second; its own death stops the writes).
# Heartbeats are written and aged by the database's clock (Now()), never a
# host's: a node whose clock is off, or a front's, still agrees on their age.
HEARTBEAT_STALE_S = 10.0


def routing_snapshot(*, heartbeat_grace_s: float = 0.0) -> routes.Snapshot:
    """Engines and models as routing sees them now: one read of the fleet.

    `heartbeat_grace_s`: heartbeats may be this much older than
    HEARTBEAT_STALE_S: the reader saw the database down that long, so no one
    could write them meanwhile (the supervisor writes again within a second of
    the database's return)."""
    stale_after_s = HEARTBEAT_STALE_S + heartbeat_grace_s
    states = {
        state.spec_id: state for state in EngineState.objects.annotate(db_now=Now())
    }
    nodes = nodes_now(heartbeat_grace_s=heartbeat_grace_s)
    engines = {}
    for spec in EngineSpec.objects.select_related("node").order_by("order", "name"):
        state = states.get(spec.pk)
        fresh = (
            state is not None
            and state.heartbeat_at is not None
            and (state.db_now - state.heartbeat_at).total_seconds() < stale_after_s
        )
        node = nodes.get(spec.node.name) if spec.node else None
        # An engine of a node that is not ready (unreachable, draining,
        # revoked...) takes no new requests, whatever it last reported.
        up = (
            spec.enabled
            and fresh
            and state.status in routes.SERVING_STATES
            and (spec.node is None or (node is not None and node.status == "ready"))
        )
        engines[spec.name] = routes.EngineStatus(
            name=spec.name,
            backend=spec.backend,
            capabilities=spec.effective_capabilities,
            up=bool(up),
            enabled=spec.enabled,
            order=spec.order,
            resident=frozenset(state.resident_model_names if state else ()),
            queue_depth=state.queue_depth if state else 0,
            slots_in_use=state.slots_in_use if state else 0,
            cooling=bool(state and state.cooling_reason),
            node=spec.node.name if spec.node else "",
            memory_mib=float(state.memory_mib or 0) if state else 0.0,
            incarnation=state.started_at.isoformat()
            if state and state.started_at
            else "",
        )
    models = {
        model.name: routes.ModelRoute(
            name=model.name,
            format=model.format,
            pin=model.engine_pin,
            task=model.task,
            created=int(model.created_at.timestamp()),
            replicas=model.replicas,
            node_labels=frozenset(model.node_labels),
            avoid_labels=frozenset(model.avoid_labels),
            memory_mib=float(model.measured_memory_mib or 0),
            share_prompt_cache=model.share_prompt_cache_across_owners,
        )
        for model in ModelConfig.objects.filter(enabled=True)
    }
    default = ServerSettings.load().default_engine
    return routes.Snapshot(
        engines=engines,
        models=models,
        default_engine=default.name if default else "",
        taken_at=time.monotonic(),
        nodes={name: node_route(node) for name, node in nodes.items()},
    )


def node_route(node: NodeView) -> NodeRoute:
    """A node as routing sees it."""
    return NodeRoute(
        name=node.name,
        status=str(node.status),
        host=node.address,
        relay_port=node.relay_port,
        tls_fingerprint=node.tls_fingerprint,
        labels=node.labels,
        ram_mib=float(node.hardware.get("ram_mib") or 0),
        copying=node.copying,
    )


def engine_counters() -> tuple[dict[str, int], dict[tuple[str, str], tuple[int, int]]]:
    """Restarts per engine, and (queued, busy) per (model, engine) resident."""
    restarts: dict[str, int] = {}
    models: dict[tuple[str, str], tuple[int, int]] = {}
    for state in EngineState.objects.select_related("spec"):
        restarts[state.spec.name] = state.restart_count
        for item in state.resident_models:
            key = (str(item.get("name", "?")), state.spec.name)
            models[key] = (int(item.get("queued", 0)), int(item.get("busy", 0)))
    return restarts, models


def fleet_overview() -> dict:
    """The fleet as the dashboard shows it: each engine with its last state,
    and the enabled models an operator may load. JSON-ready."""
    engines = []
    specs = EngineSpec.objects.select_related("state", "node").annotate(db_now=Now())
    for spec in specs.order_by("node__name", "order", "name"):
        now = spec.db_now  # the clock heartbeats and starts are written with
        state = getattr(spec, "state", None)
        if state is None:
            state = EngineState(spec=spec)
        running = state.started_at is not None and state.status not in (
            EngineStatus.STOPPED,
            EngineStatus.CRASHED,
        )
        engines.append(
            {
                "name": spec.name,
                "node": spec.node.name if spec.node else "",
                "backend": spec.backend,
                "devices": spec.devices,
                "enabled": spec.enabled,
                "status": state.status if spec.enabled else "disabled",
                "pid": state.pid,
                "uptime_s": (now - state.started_at).total_seconds()
                if running
                else None,
                "restart_count": state.restart_count,
                "heartbeat_age_s": (now - state.heartbeat_at).total_seconds()
                if state.heartbeat_at
                else None,
                "slots_in_use": state.slots_in_use,
                "queue_depth": state.queue_depth,
                "cooling_reason": state.cooling_reason,
                "last_error": state.last_error,
                "crash_loop": state.in_crash_loop,
                "temperatures": state.temperatures,
                "memory_mib": state.memory_mib,
                "tokens_generated": state.tokens_generated,
                "models": [
                    {
                        "name": item.get("name", "?"),
                        "memory_mib": item.get("memory_mib", 0),
                        "busy": item.get("busy", 0),
                        "queued": item.get("queued", 0),
                    }
                    for item in state.resident_models
                ],
            }
        )
    models = ModelConfig.objects.filter(enabled=True).order_by("name")
    return {
        "engines": engines,
        "models": [{"name": m.name, "task": m.task} for m in models],
        # A cluster's nodes, every one seen from any front ([] on one host).
        "nodes": [
            {
                "name": node.name,
                "status": str(node.status),
                "address": node.address,
                "labels": sorted(node.labels),
                "heartbeat_age_s": node.heartbeat_age_s,
            }
            for node in nodes_now().values()
        ],
    }


@dataclass(frozen=True)
class Residence:
    """One engine holding a model: the memory it takes there and, for a
    generation model, its slots and the KV pool they share."""

    engine: str
    memory_mib: float
    slots: int | None = None
    slots_auto: bool = False
    kv_pool_tokens: int | None = None
    kv_mib: float | None = None
    context: int | None = None
    kv_groups: int = 1
    kv_streams: bool = False  # a KV stream per slot instead of a shared pool
    # A GGUF model's offload plan there: the one-line reason (layers on the
    # cards, MiB per card, the rest on the CPU), "" when none was recorded.
    offload: str = ""
    # Measured there: tokens per second of its decode steps (None: no token
    # yet, or not a generation model) and what its load took on each card.
    tokens_per_s: float | None = None
    device_cards_mib: dict[str, float] | None = None


def model_residence(*, name: str) -> list[Residence]:
    """The engines that hold the model now (as the supervisor last recorded)."""
    held = []
    for state in EngineState.objects.select_related("spec").order_by("spec__name"):
        for item in state.resident_models:
            if item.get("name") == name:
                held.append(
                    Residence(
                        engine=state.spec.name,
                        memory_mib=float(item.get("memory_mib", 0)),
                        slots=item.get("slots"),
                        slots_auto=bool(item.get("slots_auto")),
                        kv_pool_tokens=item.get("kv_pool_tokens"),
                        kv_mib=item.get("kv_mib"),
                        context=item.get("context"),
                        kv_groups=item.get("kv_groups") or 1,
                        kv_streams=bool(item.get("kv_streams")),
                        offload=(item.get("offload") or {}).get("reason", ""),
                        tokens_per_s=item.get("tokens_per_s"),
                        device_cards_mib=item.get("device_cards_mib"),
                    )
                )
    return held
