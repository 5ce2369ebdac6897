"""Which engine backend serves which model format: the one compatibility table.

The admin (pin warnings, capability defaults) and routing both read it from here.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

FORMATS = ("gguf", "transformers", "embedding")
BACKENDS = ("cpu", "cuda", "rocm", "vulkan")

# A cpu engine runs everything (slowly); cuda and rocm run torch models and
# llama.cpp builds for their cards; vulkan is llama.cpp only.
BACKEND_CAPABILITIES: Mapping[str, frozenset[str]] = {
    "cpu": frozenset(FORMATS),
    "cuda": frozenset(FORMATS),
    "rocm": frozenset(FORMATS),
    "vulkan": frozenset({"gguf"}),
}


def capabilities_for(
    backend: str, override: Iterable[str] | None = None
) -> frozenset[str]:
    """The formats an engine serves: its override when given, else its backend's."""
    chosen = frozenset(override or ())
    if chosen:
        unknown = chosen - set(FORMATS)
        if unknown:
            raise ValueError(f"unknown format(s): {', '.join(sorted(unknown))}")
        return chosen
    try:
        return BACKEND_CAPABILITIES[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}") from None


@dataclass(frozen=True)
class EngineView:
    """What routing needs to know of an engine, without Django."""

    name: str
    backend: str
    capabilities: frozenset[str]
    enabled: bool = True


def pin_problem(
    *, pin: str, model_format: str, engines: Mapping[str, EngineView]
) -> str | None:
    """Why a model's engine pin cannot be honoured, or None when it can."""
    if not pin:
        return None
    engine = engines.get(pin)
    if engine is None:
        known = ", ".join(sorted(engines)) or "none"
        return f"engine {pin!r} does not exist (known engines: {known})"
    if not engine.enabled:
        return f"engine {pin!r} is disabled"
    if model_format not in engine.capabilities:
        served = ", ".join(sorted(engine.capabilities))
        return (
            f"engine {pin!r} ({engine.backend}) cannot serve {model_format} models "
            f"(it serves: {served})"
        )
    return None
