"""Ollama's /api/pull (api.dialects.ollama.pulling) through the front's ASGI handler,
against the local hub (tests/hub.py) serving the bundled SmolLM2 GGUF as
test_pulls_api.py does: Ollama's hf.co name becomes the pull's source and
the model's catalog name, its progress streams as Ollama's status lines to
`success`; a key that may not manage models, and a name that is not a
Hugging Face repository's, are refused in Ollama's shape."""

import asyncio
import json
from pathlib import Path

import httpx2 as httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from catalog.models import ModelConfig, ModelPull, PullStatus
from catalog.pull_jobs import pull_run
from tests.factories import ApiKeyFactory
from tests.hub import LocalHub
from tests.waiting import await_for

pytestmark = pytest.mark.django_db(transaction=True)

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "org/SmolLM2-135M-GGUF"
NAME = f"hf.co/{REPO}:Q4_1"


@pytest.fixture
def hub(monkeypatch, settings, tmp_path):
    """The local hub with the bundled SmolLM2 GGUF, HF_ENDPOINT pointed at
    it, and a models directory of the test's own."""
    smol = Path(settings.MODELS_DIR) / SMOL
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub({REPO: {"smol.Q4_1.gguf": smol}}) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


def front(key: str) -> httpx.AsyncClient:
    from roundhouse.asgi import api_application

    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api_application, client=("10.0.0.9", 1)),
        base_url="http://127.0.0.1",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def key_of(*, manages_models: bool) -> str:
    return ApiKeyFactory(manages_models=manages_models).plaintext


async def run_pull(pull_id: int) -> str:
    """Run the pull as a worker would, in a thread."""

    def run() -> str:
        try:
            return pull_run(pull_id)
        finally:
            connections.close_all()

    return await asyncio.to_thread(run)


async def test_a_pull_streams_ollamas_status_lines_to_success(hub):
    """The pull of hf.co/ORG/REPO:QUANT streams `pulling manifest` first and
    `success` last (downloading lines between, with their bytes), and the
    model is in the catalog under the name it was pulled by."""
    key = await sync_to_async(key_of)(manages_models=True)
    async with front(key) as client:
        answer = asyncio.create_task(client.post("/api/pull", json={"model": NAME}))
        pull = await await_for(
            lambda: ModelPull.objects.filter(name=NAME).afirst(), what="the pull"
        )
        assert pull.source == f"hf:{REPO}:Q4_1"
        assert await run_pull(pull.pk) == PullStatus.DONE
        response = await asyncio.wait_for(answer, 60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"}
    assert lines[-1] == {"status": "success"}
    assert not any("error" in line for line in lines)
    for line in lines:
        if line["status"].startswith("downloading"):
            assert line["digest"].startswith("sha256:")
            assert 0 <= line["completed"] <= line["total"]
    assert await ModelConfig.objects.filter(name=NAME).aexists()


async def test_pulls_are_refused_in_ollamas_shape(hub):
    """A key that may not manage models: 403; a name with no hf.co
    repository: 400; each `{"error"}` alone, and no pull started."""
    plain = await sync_to_async(key_of)(manages_models=False)
    async with front(plain) as client:
        response = await client.post("/api/pull", json={"model": NAME})
    assert response.status_code == 403
    assert set(response.json()) == {"error"}
    manager = await sync_to_async(key_of)(manages_models=True)
    async with front(manager) as client:
        response = await client.post("/api/pull", json={"model": "llama3.2"})
    assert response.status_code == 400
    assert "hf.co/ORG/REPO" in response.json()["error"]
    assert not await ModelPull.objects.aexists()
