"""Reads of fleet data: engines as routing sees them, ports, effective limits."""

from dataclasses import dataclass

from routing.compat import EngineView

from .models import ConcurrencySettings, EngineSpec, ServerSettings


def engine_views() -> dict[str, EngineView]:
    """Every configured engine, keyed by name, as routing sees it."""
    return {spec.name: spec.as_view() for spec in EngineSpec.objects.all()}


def engine_primary() -> EngineSpec | None:
    """The first enabled engine by order."""
    return EngineSpec.objects.filter(enabled=True).order_by("order", "name").first()


def engine_port(*, spec: EngineSpec, server: ServerSettings | None = None) -> int:
    """The spec's fixed port, else the server's base port + the spec's order."""
    if spec.port:
        return spec.port
    server = server or ServerSettings.load()
    return server.base_port + spec.order


@dataclass(frozen=True)
class EngineLimits:
    """Concurrency limits in force for one engine, overrides applied."""

    max_parallel_requests: int
    max_slots_per_model: int


def engine_limits(*, spec: EngineSpec) -> EngineLimits:
    """The default limits with this engine's override, where set, on top."""
    defaults = ConcurrencySettings.load()
    override = defaults.overrides.filter(engine=spec).first()
    return EngineLimits(
        max_parallel_requests=(override and override.max_parallel_requests)
        or defaults.max_parallel_requests,
        max_slots_per_model=(override and override.max_slots_per_model)
        or defaults.max_slots_per_model,
    )
