"""Generating on a real engine, as several engine tests (and the API's) do it: the
bundled SmolLM2's name, a GGUF or Transformers model's spec, a chat's messages,
a model's state and a wait until its slots are free, and the logprobs of a
stream."""

from pathlib import Path

from django.conf import settings

from engines.wire.replies import ModelState
from tests.waiting import wait_for

SMOL = "smollm2-135m-instruct"


def gguf_spec(name: str, filename: str, **overrides) -> dict:
    return {
        "name": name,
        "format": "gguf",
        "task": "chat",
        "path": str(Path(settings.MODELS_DIR) / filename),
        "context_length": 512,
        **overrides,
    }


def transformers_spec(name: str, path: Path | str, **overrides) -> dict:
    """A Transformers model's spec (a small context, four slots)."""
    return {
        "name": name,
        "format": "transformers",
        "path": str(path),
        "context_length": 256,
        "slots": 4,
        **overrides,
    }


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def model_state(engine, name: str) -> ModelState:
    return next(m for m in engine.client().state().models if m.name == name)


def wait_idle(engine, name: str, timeout: float = 30) -> None:
    wait_for(
        lambda: not model_state(engine, name).busy,
        timeout=timeout,
        what="the slot freed",
    )


def generated_logprobs(frames) -> list[dict]:
    return [entry for f in frames if f.event == "token" for entry in f.logprobs]
