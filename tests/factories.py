"""Factories for control-plane rows."""

import factory

from api.models import ApiKey, Usage
from api.services import api_key_issue
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


class ApiKeyFactory(factory.django.DjangoModelFactory):
    """An API key with a real generated secret, kept on the row as `plaintext`."""

    class Meta:
        model = ApiKey
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"key-{n}")

    @classmethod
    def _create(cls, model_class, *args, **kwargs):
        key = model_class(*args, **kwargs)
        key.plaintext = api_key_issue(key=key)
        return key

    @factory.post_generation
    def allowed_models(self, create, extracted, **kwargs):
        if create and extracted:
            self.allowed_models.set(extracted)


class UsageFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Usage

    key = factory.SubFactory(ApiKeyFactory)
    model = "model-a"
    engine = "cpu0"
    endpoint = "chat.completions"
    prompt_tokens = 10
    completion_tokens = 5
    latency_ms = 12.5
    status = 200
