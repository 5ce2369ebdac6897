"""Reads of catalog data: what is wrong with a model's configuration.

The catalog knows nothing of the fleet (apps depend one way: fleet → catalog):
checks against engines take the engines as an argument."""

from collections.abc import Mapping
from pathlib import Path

from routing.compat import EngineView, pin_problem

from .models import ModelConfig, ModelTask


def model_pin_problem(
    *, model: ModelConfig, engines: Mapping[str, EngineView]
) -> str | None:
    """Why the model's engine pin will be ignored, as a warning; None if it won't."""
    pin = pin_problem(pin=model.engine_pin, model_format=model.format, engines=engines)
    return f"Pin of {model.name!r} will be ignored: {pin}." if pin else None


def model_config_problems(
    *, model: ModelConfig, engines: Mapping[str, EngineView] | None = None
) -> list[str]:
    """Problems that do not block saving a model but will bite when serving it:
    its path, and, given the engines (fleet.selectors.engine_views()), its pin."""
    problems = []
    pin = engines is not None and model_pin_problem(model=model, engines=engines)
    if pin:
        problems.append(pin)
    if not model.resolved_path.exists():
        problems.append(
            f"Path of {model.name!r} does not exist here: {model.resolved_path}."
        )
    return problems


def model_paths(names: set[str]) -> dict[str, Path]:
    """Each named model's path on this host (relative paths resolved)."""
    rows = ModelConfig.objects.filter(name__in=sorted(names))
    return {model.name: model.resolved_path for model in rows}


def model_files_path(name: str) -> Path | None:
    """The path of a catalog model's files on this host, for another node to
    copy (engines/wire/link_files.py); None for a name the catalog lacks."""
    return model_paths({name}).get(name)


def models_for_chat() -> list[str]:
    """Names of the enabled chat models, in order: the chat page's picker."""
    rows = ModelConfig.objects.filter(enabled=True, task=ModelTask.CHAT)
    rows = rows.order_by("name")
    return list(rows.values_list("name", flat=True))


def models_servable_by(*, capabilities: frozenset[str]) -> list[dict]:
    """Enabled models an engine with these capabilities may load, as engine
    ModelSpec dicts (paths resolved)."""
    rows = ModelConfig.objects.filter(enabled=True, format__in=sorted(capabilities))
    return [
        {
            "name": model.name,
            "format": model.format,
            "path": str(model.resolved_path),
            "task": model.task,
            "batch_window_ms": model.batch_window_ms,
            "max_batch_size": model.max_batch_size,
            "keep_alive_s": model.keep_alive_s,
            "context_length": model.context_length,
            "slots": model.slots,
            "measured_mib": model.measured_memory_mib,
            "measured_device_mib": model.measured_device_memory_mib,
            "sampling": model.sampling,
            "chat_template": model.chat_template,
            "prompt_cache": model.prompt_cache,
            "context_overflow": model.context_overflow,
        }
        for model in rows.order_by("name")
    ]
