"""Model configs in the admin: bad pins and missing paths are warned, not hidden."""

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from catalog.models import ModelConfig
from tests.factories import EngineSpecFactory

pytestmark = pytest.mark.django_db


def model_post(**fields) -> dict:
    data = {
        "name": "qwen-test",
        "format": "gguf",
        "task": "chat",
        "path": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "enabled": "on",
        "engine_pin": "",
        "context_length": "",
        "slots": "",
        "batch_window_ms": "5",
        "max_batch_size": "64",
        "keep_alive_s": "300",
        "sampling": "{}",
        "chat_template": "",
    }
    data.update(fields)
    return data


def warnings_of(response) -> list[str]:
    return [
        m.message
        for m in get_messages(response.wsgi_request)
        if m.level_tag == "warning"
    ]


def add(admin_client, **fields):
    return admin_client.post(
        reverse("admin:catalog_modelconfig_add"), model_post(**fields)
    )


def test_good_pin_saves_without_warning(admin_client, models_dir):
    """A pin to an enabled compatible engine with an existing file: no warning."""
    response = add(admin_client, engine_pin="cpu0")
    assert response.status_code == 302
    assert warnings_of(response) == []
    assert ModelConfig.objects.get(name="qwen-test").engine_pin == "cpu0"


@pytest.mark.parametrize(
    ("pin", "expected"),
    [
        ("nosuch", "engine 'nosuch' does not exist"),
        ("off", "engine 'off' is disabled"),
        ("radeon", "engine 'radeon' (vulkan) cannot serve transformers models"),
    ],
)
def test_bad_pin_is_saved_and_warned(admin_client, models_dir, pin, expected):
    """Unknown, disabled or incompatible pins: the row is saved, a warning names why."""
    EngineSpecFactory(name="off", enabled=False)
    EngineSpecFactory(name="radeon", backend="vulkan")
    response = add(admin_client, engine_pin=pin, format="transformers", path=".")
    assert response.status_code == 302
    assert ModelConfig.objects.get(name="qwen-test").engine_pin == pin
    assert any(expected in message for message in warnings_of(response))

    page = admin_client.get(response.url).content.decode()
    assert expected.replace("'", "&#x27;") in page


def test_missing_path_is_a_warning(admin_client, models_dir):
    """A path that does not exist is saved with a warning naming the resolved path."""
    response = add(admin_client, path="nowhere/model.gguf")
    assert response.status_code == 302
    [warning] = warnings_of(response)
    assert str(models_dir / "nowhere" / "model.gguf") in warning


def test_task_must_match_format(admin_client):
    """An embedding model with a chat task is an error; nothing is saved."""
    response = add(admin_client, format="embedding", task="chat")
    assert response.status_code == 200
    assert "Embedding models have the embedding task" in response.content.decode()
    assert not ModelConfig.objects.filter(name="qwen-test").exists()


def test_sampling_is_validated(admin_client):
    """Unknown sampling names and wrong types are errors."""
    response = add(admin_client, sampling='{"temprature": 0.5, "top_k": 1.5}')
    body = response.content.decode()
    assert "unknown parameter &#x27;temprature&#x27;" in body
    assert "top_k must be a whole number" in body


def test_model_list_shows_pin_status(admin_client):
    """The list flags a model whose pin cannot be honoured."""
    ModelConfig.objects.filter(name="gemma3-270m").update(engine_pin="gpu7")
    body = admin_client.get(reverse("admin:catalog_modelconfig_changelist")).content
    assert "engine &#x27;gpu7&#x27; does not exist" in body.decode()


def test_engine_pin_input_suggests_engines(admin_client):
    """The pin field offers the configured engine names."""
    body = admin_client.get(reverse("admin:catalog_modelconfig_add")).content.decode()
    assert '<option value="cpu0">' in body


def test_list_shows_each_models_owner_engine(admin_client):
    """Owners: a pin wins; the rest go to a compatible engine (vulkan engines
    serve GGUF only, so not the embedder)."""
    from django.contrib import admin
    from django.urls import reverse

    from tests.factories import EngineSpecFactory, ModelConfigFactory

    ModelConfig.objects.all().delete()
    EngineSpecFactory(name="cpu0"), EngineSpecFactory(name="cpu1")
    EngineSpecFactory(name="vk", backend="vulkan")
    ModelConfigFactory(name="pinned", engine_pin="vk")
    ModelConfigFactory(name="embedder", format="embedding", task="embedding")
    response = admin_client.get(reverse("admin:catalog_modelconfig_changelist"))
    assert response.status_code == 200
    assert "owner engine" in response.content.decode().lower()
    listed = admin.site._registry[ModelConfig]
    assert listed.owner(ModelConfig.objects.get(name="pinned")) == "vk"
    assert listed.owner(ModelConfig.objects.get(name="embedder")) in ("cpu0", "cpu1")
