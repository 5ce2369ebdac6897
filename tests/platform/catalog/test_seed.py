"""The seed migration registers one cpu engine and the three bundled models."""

import pytest

from catalog.bundled import BUNDLED_MODELS
from catalog.models import ModelConfig
from catalog.selectors import model_config_problems
from fleet.models import EngineSpec, ServerSettings

pytestmark = pytest.mark.django_db


def test_seeded_fleet():
    """cpu0 is the primary engine and the default one."""
    primary = EngineSpec.objects.filter(enabled=True).order_by("order").first()
    assert primary.name == "cpu0" and primary.backend == "cpu"
    assert ServerSettings.load().default_engine == primary


def test_seeded_models_are_installed_and_servable(models_dir):
    """Every bundled model is registered, installed and without problems."""
    tasks = dict(ModelConfig.objects.values_list("name", "task"))
    assert tasks == {
        "smollm2-135m-instruct": "chat",
        "gemma3-270m": "completion",
        "all-minilm-l6-v2": "embedding",
    }
    for model in ModelConfig.objects.all():
        assert model_config_problems(model=model) == []
    assert all(bundled.is_installed(models_dir) for bundled in BUNDLED_MODELS)
