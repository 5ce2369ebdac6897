"""Prometheus metrics of the front: what it served (counted here, per model and
engine) and what the fleet is doing (read from the routing snapshot)."""

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from routing.select import Snapshot

# `*_created` series double the output and no dashboard here reads them.
disable_created_metrics()
REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "roundhouse_requests",
    "API requests answered, by endpoint, model, engine and HTTP status.",
    ["endpoint", "model", "engine", "status"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "roundhouse_tokens",
    "Tokens processed, by model, engine and kind (prompt, completion; of the "
    "prompt tokens: prompt_cached from a slot's cache, prompt_evaluated).",
    ["model", "engine", "kind"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "roundhouse_request_latency_seconds",
    "Time from request to last byte, by endpoint and model.",
    ["endpoint", "model"],
    registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
TIME_TO_FIRST_TOKEN = Histogram(
    "roundhouse_time_to_first_token_seconds",
    "Time from request to the first streamed token, by model.",
    ["model"],
    registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

USAGE_ROWS_DROPPED = Counter(
    "roundhouse_usage_rows_dropped",
    "Usage rows never written, by reason: queue_full (the writer was that far "
    "behind), database_error (the database still failed after the retries), "
    "refused (the database refused the row), error (a bug).",
    ["reason"],
    registry=REGISTRY,
)
for _reason in ("queue_full", "database_error", "refused", "error"):
    USAGE_ROWS_DROPPED.labels(_reason)  # shown from the start, at 0
USAGE_WRITE_FAILURES = Counter(
    "roundhouse_usage_write_failures",
    "Writes of a batch of usage rows that failed with a database error (each "
    "is tried again, up to a limit).",
    registry=REGISTRY,
)


class FleetCollector:
    """Engine gauges from the latest routing snapshot (at most a second old)."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.restarts: dict[str, int] = {}
        self.model_queues: dict[tuple[str, str], tuple[int, int]] = {}

    def collect(self):
        up = GaugeMetricFamily(
            "roundhouse_engine_up",
            "1 if the engine is ready; `node`: its host on a cluster.",
            labels=["engine", "node"],
        )
        node_status = GaugeMetricFamily(
            "roundhouse_node_status",
            "1 for each node's current status (ready, draining, unreachable, "
            "down, revoked, pending), as every front sees the cluster.",
            labels=["node", "status"],
        )
        cooling = GaugeMetricFamily(
            "roundhouse_engine_cooling",
            "1 while the engine is paused by its thermal gate.",
            labels=["engine"],
        )
        queue = GaugeMetricFamily(
            "roundhouse_engine_queue_depth",
            "Requests queued in the engine.",
            labels=["engine"],
        )
        slots = GaugeMetricFamily(
            "roundhouse_engine_slots_in_use",
            "Generation slots busy in the engine.",
            labels=["engine"],
        )
        restarts = CounterMetricFamily(
            "roundhouse_engine_restarts",
            "Times the supervisor respawned the engine.",
            labels=["engine"],
        )
        resident = GaugeMetricFamily(
            "roundhouse_model_resident",
            "1 while the model is resident in the engine.",
            labels=["model", "engine"],
        )
        model_queue = GaugeMetricFamily(
            "roundhouse_model_queue_depth",
            "Requests queued for the model in the engine.",
            labels=["model", "engine"],
        )
        model_busy = GaugeMetricFamily(
            "roundhouse_model_slots_in_use",
            "Slots of the model busy in the engine.",
            labels=["model", "engine"],
        )
        if self.snapshot is not None:
            for engine in self.snapshot.engines.values():
                up.add_metric([engine.name, engine.node], 1 if engine.up else 0)
                cooling.add_metric([engine.name], 1 if engine.cooling else 0)
                queue.add_metric([engine.name], engine.queue_depth)
                slots.add_metric([engine.name], engine.slots_in_use)
                restarts.add_metric([engine.name], self.restarts.get(engine.name, 0))
                for model in sorted(engine.resident):
                    resident.add_metric([model, engine.name], 1)
            for (model, engine), (queued, busy) in self.model_queues.items():
                model_queue.add_metric([model, engine], queued)
                model_busy.add_metric([model, engine], busy)
            for node in self.snapshot.nodes.values():
                node_status.add_metric([node.name, node.status], 1)
        yield from (up, cooling, queue, slots, restarts, node_status)
        yield from (resident, model_queue, model_busy)


FLEET = FleetCollector()
REGISTRY.register(FLEET)


def exposition() -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(REGISTRY)
