"""Partial offload in a real engine: a `cuda` engine plans each GGUF load over
its cards' free memory, loads with the plan and reports it in `state`.

This machine has no GPU: the cards are described by
ROUNDHOUSE_DEVICE_MEMORY_FILE (the interface nvidia-smi feeds), and the CPU
build of llama.cpp takes the plan's n_gpu_layers, split mode and tensor split
and runs every layer on the CPU, so the wiring is real end to end but for the
cards themselves. SmolLM2 with one 256-token slot: 30 layers of ~2.3 MiB with
their KV, a ~10 MiB compute buffer where layers run, ~97 MiB (its 49,152
logits) where the output layer runs."""

import json
from pathlib import Path

import pytest
from django.conf import settings

from engines.wire.client import EngineRequestError
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import start_engine


def smollm(name: str, **settings_) -> dict:
    return {
        "name": name,
        "format": "gguf",
        "path": str(Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "context_length": 256,
        "slots": 1,
        **settings_,
    }


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A cuda engine owning cards GPU-1 and GPU-2 (free memory set by each
    test), margin 10 MiB."""
    card = tmp_path / "gpus.json"
    monkeypatch.setenv("ROUNDHOUSE_DEVICE_MEMORY_FILE", str(card))
    engine = start_engine(
        tmp_path,
        backend="cuda",
        devices=["GPU-1", "GPU-2"],
        limits={"memory_margin_mib": 10, "models_max": 5, "queue_timeout_s": 2},
        models=[
            smollm("auto"),
            smollm("all", gpu_layers="all"),
            smollm("three", gpu_layers="3"),
            smollm("split", tensor_split="1,3"),
        ],
    )

    def set_free(*free: float) -> None:
        gpus = [
            {"id": f"GPU-{n}", "total_mib": 8000, "used_mib": 8000 - mib}
            for n, mib in enumerate(free, start=1)
        ]
        card.write_text(json.dumps({"gpus": gpus}))

    engine.set_free = set_free
    yield engine
    engine.stop()


def answer(engine, name: str) -> str:
    request = GenerateRequest(
        model=name, prompt="The capital of France is", max_tokens=4
    )
    return engine.client().generate(request).text


def offload_of(engine, name: str):
    return {m.name: m for m in engine.client().state().models}[name].offload


def test_a_model_on_roomy_cards_is_all_offloaded_split_by_free_memory(engine):
    engine.set_free(6010, 2010)
    assert answer(engine, "auto")
    offload = offload_of(engine, "auto")
    assert (offload.gpu_layers, offload.layers) == (31, 31)
    # GPU-1 takes three quarters of the layers, GPU-2 the rest and the
    # output layer (with its logits' compute buffer).
    assert set(offload.cards_mib) == {"GPU-1", "GPU-2"}
    assert all(mib > 0 for mib in offload.cards_mib.values())
    assert offload.reason.startswith("31 of 31 layers on 2 cards (GPU-1 ")
    # Beside the plan, `state` carries what was measured: the model's
    # tokens/s (its answer's tokens over its decode steps' time).
    (model,) = [m for m in engine.client().state().models if m.name == "auto"]
    assert model.tokens_per_s > 0


def test_a_model_larger_than_the_cards_runs_partly_on_the_cpu(engine):
    """30 MiB free on each card (20 MiB less the margin): a few layers on
    each, the rest and the output layer on the CPU; the model answers."""
    engine.set_free(30, 30)
    assert answer(engine, "auto")
    offload = offload_of(engine, "auto")
    assert 0 < offload.gpu_layers < 31
    assert all(0 < mib <= 20 for mib in offload.cards_mib.values())
    assert offload.reason.endswith(f"{31 - offload.gpu_layers} on the CPU")


def test_cards_too_small_for_a_layer_leave_it_on_the_cpu(engine):
    engine.set_free(12, 12)
    assert answer(engine, "auto")
    offload = offload_of(engine, "auto")
    assert offload.gpu_layers == 0
    assert offload.reason.startswith("no layer fits: a layer needs ")


def test_the_models_settings_override_the_plan(engine):
    """A number of layers is taken as asked; shares split as they say; `all`
    on cards too small is refused before it loads, as a whole-GPU model is."""
    engine.set_free(30, 30)
    with pytest.raises(EngineRequestError) as error:
        answer(engine, "all")
    assert error.value.code == "insufficient_memory"
    assert "of GPU memory" in error.value.message
    engine.set_free(6010, 6010)
    assert answer(engine, "three")
    assert offload_of(engine, "three").gpu_layers == 3
    assert answer(engine, "split")
    cards = offload_of(engine, "split").cards_mib
    assert cards["GPU-2"] > 2 * cards["GPU-1"]


def test_a_model_that_fits_nowhere_is_refused_with_the_reason(tmp_path, monkeypatch):
    """Cards too small and a host margin larger than any host: refused before
    loading, saying so."""
    card = tmp_path / "gpus.json"
    card.write_text(
        json.dumps({"gpus": [{"id": "GPU-1", "total_mib": 100, "used_mib": 90}]})
    )
    monkeypatch.setenv("ROUNDHOUSE_DEVICE_MEMORY_FILE", str(card))
    engine = start_engine(
        tmp_path,
        backend="cuda",
        devices=["GPU-1"],
        limits={"memory_margin_mib": 10**8},
        models=[smollm("auto")],
    )
    try:
        with pytest.raises(EngineRequestError) as error:
            answer(engine, "auto")
        assert error.value.code == "insufficient_memory"
        assert "auto fits nowhere" in error.value.message
        assert "layers that would run on the CPU" in error.value.message
        assert not engine.client().state().models
    finally:
        engine.stop()


def test_a_cpu_engine_reports_no_offload(tmp_path):
    engine = start_engine(tmp_path, models=[smollm("auto", gpu_layers="all")])
    try:
        assert answer(engine, "auto")
        assert offload_of(engine, "auto") is None
    finally:
        engine.stop()
