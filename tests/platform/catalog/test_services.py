"""Storing what a load measured (host RAM and GPU memory) on the model."""

import pytest

from catalog.models import ModelConfig
from catalog.selectors import models_servable_by
from catalog.services import model_memory_record
from tests.factories import ModelConfigFactory

pytestmark = pytest.mark.django_db


def test_host_and_device_memory_are_stored_and_reach_the_engines():
    model = ModelConfigFactory(name="m", format="gguf")
    assert model_memory_record(name="m", memory_mib=120.4, device_memory_mib=950.6)
    model.refresh_from_db()
    assert (model.measured_memory_mib, model.measured_device_memory_mib) == (120, 951)
    specs = models_servable_by(capabilities=frozenset({"gguf"}))
    [spec] = [spec for spec in specs if spec["name"] == "m"]
    assert (spec["measured_mib"], spec["measured_device_mib"]) == (120, 951)


def test_small_changes_are_not_written_and_zero_means_unmeasured():
    ModelConfigFactory(name="m")
    model_memory_record(name="m", memory_mib=100, device_memory_mib=1000)
    assert not model_memory_record(name="m", memory_mib=105, device_memory_mib=0)
    assert model_memory_record(name="m", memory_mib=105, device_memory_mib=1500)
    model = ModelConfig.objects.get(name="m")
    assert (model.measured_memory_mib, model.measured_device_memory_mib) == (100, 1500)
    assert not model_memory_record(name="unknown", memory_mib=1)
