"""Model configs in the admin: bad pins and missing paths are warned, not hidden."""

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from catalog.models import ModelConfig
from tests.factories import EngineSpecFactory
from tests.platform.catalog.model_form import model_add

pytestmark = pytest.mark.django_db


def warnings_of(response) -> list[str]:
    return [
        m.message
        for m in get_messages(response.wsgi_request)
        if m.level_tag == "warning"
    ]


def test_good_pin_saves_without_warning(admin_client, models_dir):
    """A pin to an enabled compatible engine with an existing file: no warning."""
    response = model_add(admin_client, engine_pin="cpu0")
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
    response = model_add(admin_client, engine_pin=pin, format="transformers", path=".")
    assert response.status_code == 302
    assert ModelConfig.objects.get(name="qwen-test").engine_pin == pin
    assert any(expected in message for message in warnings_of(response))

    page = admin_client.get(response.url).content.decode()
    assert expected.replace("'", "&#x27;") in page


def test_missing_path_is_a_warning(admin_client, models_dir):
    """A path that does not exist is saved with a warning naming the resolved path."""
    response = model_add(admin_client, path="nowhere/model.gguf")
    assert response.status_code == 302
    [warning] = warnings_of(response)
    assert str(models_dir / "nowhere" / "model.gguf") in warning


def test_task_must_match_format(admin_client):
    """A sentence-transformers model with a chat task is an error, and so is
    a GGUF model with the rerank task; nothing is saved."""
    for format_, task in (("embedding", "chat"), ("gguf", "rerank")):
        response = model_add(admin_client, format=format_, task=task)
        assert response.status_code == 200
        assert "Sentence-transformers models have the embedding task" in (
            response.content.decode()
        )
        assert not ModelConfig.objects.filter(name="qwen-test").exists()


def test_a_cross_encoder_has_the_rerank_task(admin_client):
    """A sentence-transformers model with the rerank task (a cross-encoder)
    is saved: the control for the refusals above."""
    response = model_add(admin_client, format="embedding", task="rerank")
    assert response.status_code == 302
    assert ModelConfig.objects.get(name="qwen-test").task == "rerank"


def test_sampling_is_validated(admin_client):
    """Unknown sampling names and wrong types are errors."""
    response = model_add(admin_client, sampling='{"temprature": 0.5, "top_k": 1.5}')
    body = response.content.decode()
    assert "unknown parameter &#x27;temprature&#x27;" in body
    assert "top_k must be a whole number" in body


def test_deleting_a_variant_removes_the_file_its_job_wrote(
    admin_client, settings, tmp_path
):
    """A requantized variant's file goes with it, from the list's delete
    action and from its own page; an ordinary model's file stays (control),
    and so does a variant file another model still points at."""
    settings.MODELS_DIR = tmp_path
    (tmp_path / "requantized").mkdir()
    original = ModelConfig.objects.create(
        name="orig", format="gguf", task="chat", path="orig.gguf"
    )
    files = {}
    for name in ("orig", "v-q4_0", "v-q8_0", "v-q5_0"):
        files[name] = tmp_path / (
            "orig.gguf" if name == "orig" else f"requantized/{name}.gguf"
        )
        files[name].write_bytes(b"GGUF")
    variants = {
        name: ModelConfig.objects.create(
            name=name,
            format="gguf",
            task="chat",
            path=f"requantized/{name}.gguf",
            derived_from=original,
            quantized_to=name.split("-")[1].upper(),
        )
        for name in ("v-q4_0", "v-q8_0", "v-q5_0")
    }
    ModelConfig.objects.create(
        name="same-file", format="gguf", task="chat", path="requantized/v-q5_0.gguf"
    )
    changelist = reverse("admin:catalog_modelconfig_changelist")
    chosen = [variants["v-q4_0"].pk, original.pk, variants["v-q5_0"].pk]
    admin_client.post(
        changelist,
        {"action": "delete_selected", "_selected_action": chosen, "post": "yes"},
    )
    page = reverse("admin:catalog_modelconfig_delete", args=[variants["v-q8_0"].pk])
    admin_client.post(page, {"post": "yes"})
    assert not ModelConfig.objects.filter(name__startswith="v-").exists()
    assert not files["v-q4_0"].exists() and not files["v-q8_0"].exists()
    assert files["orig"].exists()  # not a variant: the operator's file
    assert files["v-q5_0"].exists()  # "same-file" still serves it


def test_the_change_page_says_whether_the_template_renders_tools(admin_client):
    """From the inspection of its files, or from the template set here, which
    replaces theirs: whether tools go through the model's template or are
    described by Roundhouse."""
    model = ModelConfig.objects.create(
        name="plain",
        format="gguf",
        task="chat",
        path="SmolLM2-135M-Instruct.Q4_1.gguf",
        inspection={"architecture": "llama", "chat_template": True},
    )
    page = reverse("admin:catalog_modelconfig_change", args=[model.pk])
    assert "chat template without tools (Roundhouse describes them)" in (
        admin_client.get(page).content.decode()
    )
    model.chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}"
    model.save()
    assert "chat template set here rendering tools" in (
        admin_client.get(page).content.decode()
    )
