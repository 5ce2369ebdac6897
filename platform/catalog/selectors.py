"""Reads of catalog data: what is wrong with a model's configuration."""

from fleet.selectors import engine_views
from routing.compat import EngineView, pin_problem

from .models import ModelConfig


def model_config_problems(
    *, model: ModelConfig, engines: dict[str, EngineView] | None = None
) -> list[str]:
    """Problems that do not block saving a model but will bite when serving it."""
    problems = []
    engines = engine_views() if engines is None else engines
    pin = pin_problem(pin=model.engine_pin, model_format=model.format, engines=engines)
    if pin:
        problems.append(f"Pin of {model.name!r} will be ignored: {pin}.")
    if not model.resolved_path.exists():
        problems.append(
            f"Path of {model.name!r} does not exist here: {model.resolved_path}."
        )
    return problems
