"""The compatibility table: which backend serves which format."""

import pytest

from routing.compat import EngineView, capabilities_for, pin_problem


def view(name="gpu0", backend="cuda", enabled=True, override=None):
    return EngineView(
        name=name,
        backend=backend,
        capabilities=capabilities_for(backend, override),
        enabled=enabled,
    )


@pytest.mark.parametrize(
    ("backend", "formats"),
    [
        ("cpu", {"gguf", "transformers", "embedding"}),
        ("cuda", {"gguf", "transformers", "embedding"}),
        ("vulkan", {"gguf"}),
    ],
)
def test_capabilities_default_from_backend(backend, formats):
    """Without an override an engine serves its backend's formats."""
    assert capabilities_for(backend) == formats


def test_override_replaces_backend_defaults():
    """An override lists exactly the formats served."""
    assert capabilities_for("cuda", ["gguf"]) == {"gguf"}


def test_unknown_backend_and_format_are_errors():
    """Typos are errors, not silently empty capability sets."""
    with pytest.raises(ValueError, match="backend"):
        capabilities_for("tpu")
    with pytest.raises(ValueError, match="format"):
        capabilities_for("cpu", ["onnx"])


def test_pin_problems_name_the_cause():
    """Unknown, disabled and incompatible pins each explain themselves."""
    engines = {
        "gpu0": view(),
        "radeon": view("radeon", "vulkan"),
        "off": view("off", "cpu", enabled=False),
    }
    assert pin_problem(pin="", model_format="gguf", engines=engines) is None
    assert pin_problem(pin="gpu0", model_format="transformers", engines=engines) is None
    assert "does not exist" in pin_problem(
        pin="gpu9", model_format="gguf", engines=engines
    )
    assert "disabled" in pin_problem(pin="off", model_format="gguf", engines=engines)
    problem = pin_problem(pin="radeon", model_format="transformers", engines=engines)
    assert "cannot serve transformers" in problem
