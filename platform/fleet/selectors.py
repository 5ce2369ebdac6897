"""Reads of fleet data: engines as routing sees them, ports, effective limits."""

import json
from dataclasses import dataclass

from routing.compat import EngineView

from .models import ConcurrencySettings, EngineSpec, ServerSettings, ThermalSettings


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


@dataclass(frozen=True)
class DesiredEngine:
    """An enabled spec as the supervisor should run it."""

    spec_id: int
    name: str
    port: int
    backend: str
    env: dict[str, str]
    devices: str
    restart_requested_at: object
    config: dict

    @property
    def spawn_key(self) -> str:
        """What forces a restart when it changes (unlike limits, pushed live)."""
        return json.dumps(
            [self.name, self.port, self.backend, self.env, self.devices],
            sort_keys=True,
        )

    @property
    def config_key(self) -> str:
        return json.dumps(self.config, sort_keys=True)


def thermal_thresholds() -> dict:
    """ThermalSettings and its per-vendor overrides, as engines read them."""
    settings = ThermalSettings.load()
    return {
        "cpu_high": settings.cpu_high,
        "cpu_resume": settings.cpu_resume,
        "gpu_high": settings.gpu_high,
        "gpu_resume": settings.gpu_resume,
        "overrides": {
            row.vendor: {"high": row.high, "resume": row.resume}
            for row in settings.overrides.all()
        },
    }


def engines_desired() -> list[DesiredEngine]:
    """Every enabled engine with the configuration it should be running."""
    from catalog.selectors import models_servable_by

    server = ServerSettings.load()
    thermal = thermal_thresholds()
    desired = []
    for spec in EngineSpec.objects.filter(enabled=True).order_by("order", "name"):
        limits = engine_limits(spec=spec)
        config = {
            "name": spec.name,
            "port": engine_port(spec=spec, server=server),
            "backend": spec.backend,
            "limits": {
                "max_parallel_requests": limits.max_parallel_requests,
                "max_slots_per_model": limits.max_slots_per_model,
                "queue_limit": server.queue_limit,
                "queue_timeout_s": server.queue_timeout_s,
                "models_max": server.models_max,
                "memory_margin_mib": server.memory_margin_mib,
            },
            "models": models_servable_by(capabilities=spec.effective_capabilities),
            "thermal": thermal,
            "devices": spec.device_list,
        }
        desired.append(
            DesiredEngine(
                spec_id=spec.pk,
                name=spec.name,
                port=config["port"],
                backend=spec.backend,
                env=dict(spec.env),
                devices=spec.devices,
                restart_requested_at=spec.restart_requested_at,
                config=config,
            )
        )
    return desired
