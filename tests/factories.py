"""Factories for control-plane rows."""

import factory

from catalog.models import ModelConfig
from fleet.models import EngineSpec


class EngineSpecFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EngineSpec
        django_get_or_create = ["name"]

    name = factory.Sequence(lambda n: f"engine{n}")
    backend = "cpu"
    order = factory.Sequence(lambda n: n + 10)


class ModelConfigFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelConfig

    name = factory.Sequence(lambda n: f"model-{n}")
    format = "gguf"
    task = "chat"
    path = "SmolLM2-135M-Instruct.Q4_1.gguf"
