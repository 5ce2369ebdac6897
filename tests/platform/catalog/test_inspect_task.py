"""Model inspection through a real Celery worker process on the broker the
settings choose (kombu's filesystem transport in the run dir by default,
Redis when REDIS_URL is set), against the test database: a model added in the
admin is inspected once the add commits, and again when its path changes."""

from pathlib import Path

from django.urls import reverse

from catalog.models import ModelConfig
from tests.platform.catalog.model_form import model_post
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]


def inspected(name: str, after=None):
    model = ModelConfig.objects.get(name=name)
    if model.inspected_at is None or (after and model.inspected_at <= after):
        return None
    return model


def test_a_worker_inspects_a_model_when_added_and_when_its_path_changes(
    worker, admin_client
):
    process, log = worker
    response = admin_client.post(
        reverse("admin:catalog_modelconfig_add"), model_post(name="smol-inspected")
    )
    assert response.status_code == 302
    model = wait_for(
        lambda: inspected("smol-inspected"),
        timeout=120,
        what=f"the inspection (worker log: {log})",
    )
    assert model.inspection["architecture"] == "llama"
    assert model.inspection["quantization"] == "Q4_1"
    assert model.inspection["parameters"] == 134_515_008
    assert model.inspection["chat_template"] is True
    assert model.inspection["problem"] == ""
    url = reverse("admin:catalog_modelconfig_change", args=[model.pk])
    response = admin_client.post(
        url, model_post(name="smol-inspected", path="gone.gguf")
    )
    assert response.status_code == 302
    again = wait_for(
        lambda: inspected("smol-inspected", after=model.inspected_at),
        timeout=120,
        what="the second inspection",
    )
    assert again.inspection["problem"].startswith("not found")
    body = admin_client.get(url).content.decode()
    assert "problem: not found" in body
    assert process.poll() is None  # the worker is still up
    # The broker's folders are all in the run dir, none in the working dir
    # (kombu's default control folder is ./control).
    assert not (ROOT / "control").exists()
