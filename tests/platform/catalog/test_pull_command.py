"""`manage.py pull` against the local hub (tests/hub.py), found through
HF_ENDPOINT as a mirror would be: the model's facts
before the download, its file in place, its row read from its header; a name
taken refused before a byte."""

from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from catalog.models import ModelConfig
from tests.factories import ModelConfigFactory
from tests.hub import LocalHub

pytestmark = pytest.mark.django_db

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "org/SmolLM2-135M-GGUF"


@pytest.fixture
def hub(monkeypatch, settings, tmp_path):
    smol = Path(settings.MODELS_DIR) / SMOL
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub({REPO: {"smol.Q4_1.gguf": smol, "README.md": b"hi\n"}}) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


def test_a_model_is_pulled_and_added(hub, capsys):
    call_command("pull", f"hf:{REPO}:q4_1")
    out = capsys.readouterr()
    assert "llama, chat, trained context 8192; needs" in out.out
    model = ModelConfig.objects.get(name="smollm2-135m:q4_1")
    assert (model.format, model.task) == ("gguf", "chat")
    assert model.path == "org--SmolLM2-135M-GGUF/smol.Q4_1.gguf"
    assert (Path(settings.MODELS_DIR) / model.path).stat().st_size == hub.blob(
        REPO, "smol.Q4_1.gguf"
    ).size
    assert " MiB (" in out.err  # the progress line


def test_a_taken_name_is_refused_before_the_download(hub):
    """Control: the same pull under a free name is served bytes."""
    ModelConfigFactory(name="taken")
    with pytest.raises(CommandError, match="a model named taken exists"):
        call_command("pull", f"hf:{REPO}", "--name", "taken")
    assert hub.bytes_served(REPO, "smol.Q4_1.gguf") < 4 << 20  # the header only
    call_command("pull", f"hf:{REPO}", "--name", "free")
    assert (
        hub.bytes_served(REPO, "smol.Q4_1.gguf") > hub.blob(REPO, "smol.Q4_1.gguf").size
    )


def test_a_bad_source_and_an_unknown_quantization_say_what_to_give(hub):
    with pytest.raises(CommandError, match="is not hf:ORG/REPO"):
        call_command("pull", "ollama:smol")
    with pytest.raises(CommandError, match="its GGUF files: Q4_1"):
        call_command("pull", f"hf:{REPO}:Q8_0")


def test_a_pulled_model_answers_a_chat(hub, tmp_path):
    """The pulled file, served by a real engine from its catalog path, answers."""
    from engines.wire.requests import GenerateRequest
    from tests.engines.conftest import start_engine
    from tests.engines.generating import gguf_spec

    call_command("pull", f"hf:{REPO}:Q4_1", "--name", "pulled")
    model = ModelConfig.objects.get(name="pulled")
    engine = start_engine(
        tmp_path / "engine",
        models=[gguf_spec("pulled", model.path, task=model.task)],
        preload=["pulled"],
    )
    try:
        answer = engine.client().generate(
            GenerateRequest(
                model="pulled",
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
                temperature=0,
            )
        )
    finally:
        engine.stop()
    assert answer.text.strip() and answer.usage.completion_tokens > 0


def test_an_unknown_node_is_refused_before_anything_is_queued(hub):
    """Control: with no --node, the same source is pulled here."""
    from catalog.models import ModelPull

    with pytest.raises(CommandError, match="no node named nowhere"):
        call_command("pull", f"hf:{REPO}:Q4_1", "--node", "nowhere")
    assert not ModelPull.objects.exists()
    assert hub.bytes_served(REPO, "smol.Q4_1.gguf") == 0
