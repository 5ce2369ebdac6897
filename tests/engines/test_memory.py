"""Memory estimates from model files, before any load."""

from pathlib import Path

import pytest
from django.conf import settings

from engines.config import ModelSpec
from engines.memory import estimate_model_mib


def spec(fmt: str, path: str, context: int | None = 512) -> ModelSpec:
    return ModelSpec(
        name="m",
        format=fmt,
        path=str(Path(settings.MODELS_DIR) / path),
        context_length=context,
    )


def test_gguf_estimate_is_file_size_plus_kv_per_slot():
    """SmolLM2: 30 layers, 3 KV heads x 64 dims, f16 K and V, per context token."""
    model = spec("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    file_mib = Path(model.path).stat().st_size / 2**20
    kv_per_token_mib = 2 * 30 * 192 * 2 / 2**20
    one = estimate_model_mib(model, slots=1)
    eight = estimate_model_mib(model, slots=8)
    assert one == pytest.approx(file_mib + 512 * kv_per_token_mib)
    assert eight - one == pytest.approx(7 * 512 * kv_per_token_mib)


def test_transformers_from_gguf_counts_float32_weights():
    """A GGUF loaded by transformers is dequantized: 4 bytes per parameter."""
    estimate = estimate_model_mib(
        spec("transformers", "SmolLM2-135M-Instruct.Q4_1.gguf", 256), slots=1
    )
    assert 134_515_008 * 4 / 2**20 < estimate < 134_515_008 * 4 / 2**20 + 50


def test_embedder_estimate_is_its_weights():
    estimate = estimate_model_mib(spec("embedding", "all-MiniLM-L6-v2", None), slots=1)
    assert 80 < estimate < 95
