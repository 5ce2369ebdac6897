"""Requantization through a real Celery worker process and the real
quantize / evaluate children: the admin action (with its page to choose the
quantization) registers a variant of the bundled SmolLM2 (Q4_1) in Q4_0, the
worker writes its file under the models directory and measures both models
here, and the admin shows them side by side. Asking again refreshes the same
variant."""

import json
import math

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from catalog.models import JobState, ModelConfig
from catalog.services import model_requantize_queue
from tests.factories import ModelConfigFactory
from tests.waiting import wait_for

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def own_models_dir(settings, models_dir, tmp_path):
    """A models directory of this test's own (the worker is started with it),
    holding the bundled model: variants are written under it, not under the
    shared one."""
    own = tmp_path / "models"
    own.mkdir()
    (own / SMOL).symlink_to(models_dir / SMOL)
    settings.MODELS_DIR = own
    return own


def requantize_post(admin_client, *models, **fields):
    data = {"action": "requantize", "_selected_action": [m.pk for m in models]}
    return admin_client.post(
        reverse("admin:catalog_modelconfig_changelist"), data | fields
    )


def requantized(name: str, after: str = ""):
    """The variant once its job failed, or succeeded with a comparison newer
    than `after`."""
    variant = ModelConfig.objects.filter(name=name).first()
    if variant is None or variant.requantize_job == JobState.FAILED:
        return variant
    done = variant.requantize_job == JobState.DONE
    return variant if done and variant.comparison["measured_at"] > after else None


def test_a_worker_requantizes_a_model_and_compares_the_pair(
    worker, admin_client, own_models_dir
):
    """The action's page, then a disabled variant queued; the worker writes
    its Q4_0 file, compares the pair (smaller, faster, close in perplexity and
    agreement) and enables it; both change forms show the comparison. The
    same request again refreshes that variant and leaves it as the operator
    set it."""
    process, log = worker
    original = ModelConfigFactory(name="smol", context_length=512)
    page = requantize_post(admin_client, original, index=0)
    assert page.status_code == 200  # the page to choose the quantization
    assert b'<option value="Q4_0" selected>Q4_0</option>' in page.content
    response = requantize_post(admin_client, original, quantization="Q4_0", apply="1")
    assert response.status_code == 302
    variant = ModelConfig.objects.get(derived_from=original)
    assert (variant.name, variant.quantized_to) == ("smol-q4_0", "Q4_0")
    assert variant.requantize_job == JobState.QUEUED
    assert not variant.enabled  # until its file exists
    assert (variant.context_length, variant.task) == (512, original.task)

    what = f"the requantization (worker log: {log})"
    variant = wait_for(lambda: requantized("smol-q4_0"), timeout=600, what=what)
    assert variant.requantize_job == JobState.DONE, variant.requantize_job_progress
    assert variant.enabled and variant.engine_pin == ""
    assert variant.resolved_path == own_models_dir / "requantized" / "smol-q4_0.gguf"
    assert variant.resolved_path.is_file()
    assert variant.inspection["quantization"] == "Q4_0"
    pair = variant.comparison
    print("comparison:", json.dumps(pair, indent=1))  # the figures, for the record
    before, after = pair["original"], pair["variant"]
    assert (before["quantization"], after["quantization"]) == ("Q4_1", "Q4_0")
    assert after["file_mib"] < before["file_mib"]
    for side in (before, after):
        assert side["prompt_tps"] > 0 and side["generation_tps"] > 0
        assert 1 < side["perplexity"] < 100 and math.isfinite(side["perplexity"])
    # A requantized model is close to, not the same as, its original.
    assert 0.5 < after["agreement"] <= 1
    assert 0.67 < after["perplexity"] / before["perplexity"] < 1.5

    body = admin_client.get(
        reverse("admin:catalog_modelconfig_change", args=[variant.pk])
    ).content.decode()
    for row in ("prompt tokens/s", "generation tokens/s", "perplexity"):
        assert f"<th>{row}" in body
    assert f"<td>{after['prompt_tps']:,.1f}</td>" in body
    assert "greedy agreement, next token</th><td>reference</td>" in body
    body = admin_client.get(
        reverse("admin:catalog_modelconfig_change", args=[original.pk])
    ).content.decode()
    assert "smol-q4_0</a> (Q4_0): done" in body

    # Again, to the same quantization: the same variant, refreshed.
    ModelConfig.objects.filter(pk=variant.pk).update(enabled=False)
    response = requantize_post(admin_client, original, quantization="Q4_0", apply="1")
    assert response.status_code == 302
    assert ModelConfig.objects.filter(derived_from=original).count() == 1
    again = wait_for(
        lambda: requantized("smol-q4_0", after=pair["measured_at"]),
        timeout=600,
        what=what,
    )
    assert again.pk == variant.pk and again.requantize_job == JobState.DONE
    assert again.comparison["measured_at"] > pair["measured_at"]
    assert not again.enabled  # the operator's choice stands
    assert sorted(p.name for p in (own_models_dir / "requantized").iterdir()) == [
        "smol-q4_0.gguf"
    ]
    assert process.poll() is None


@pytest.mark.django_db
def test_only_gguf_models_are_requantized_and_names_are_not_taken(
    admin_client, django_capture_on_commit_callbacks
):
    """Nothing is sent here (the callbacks are captured, not run): an
    embedding model is skipped with a warning, and a variant whose name
    another model has is refused, that model untouched."""
    embedder = ModelConfigFactory(
        name="minilm", format="embedding", task="embedding", path="all-MiniLM-L6-v2"
    )
    smol = ModelConfigFactory(name="smol")
    taken = ModelConfigFactory(name="smol-q8_0", path="other.gguf")
    with django_capture_on_commit_callbacks() as sent:
        response = requantize_post(
            admin_client, embedder, smol, quantization="Q8_0", apply="1"
        )
    assert response.status_code == 302
    said = [str(m) for m in get_messages(response.wsgi_request)]
    assert "Skipped: minilm is not a GGUF model." in said
    assert any("Skipped smol:" in m and "already exists" in m for m in said)
    assert sent == []
    assert not ModelConfig.objects.filter(derived_from__isnull=False).exists()
    taken.refresh_from_db()
    assert (taken.path, taken.derived_from) == ("other.gguf", None)
    with django_capture_on_commit_callbacks() as sent:
        first = model_requantize_queue(model=smol, quantization="Q5_0")
        second = model_requantize_queue(model=smol, quantization="Q5_0")
    assert first.pk == second.pk and len(sent) == 2
    assert first.path == "requantized/smol-q5_0.gguf"
