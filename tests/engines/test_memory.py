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


def test_header_reader_agrees_with_the_gguf_package():
    """The fast header reader gives the keys and parameter count that the gguf
    package's full reader gives (the reference), and remembers the file."""
    from gguf import GGUFReader

    from engines.ggufmeta import read_header

    path = Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reference = GGUFReader(str(path))
    header = read_header(path)
    arch = header.get("general.architecture")
    assert arch == str(
        bytes(reference.fields["general.architecture"].parts[-1]), "utf-8"
    )
    for key in ("block_count", "embedding_length", "attention.head_count_kv"):
        field = reference.fields[f"{arch}.{key}"]
        assert header.get(f"{arch}.{key}") == int(field.parts[field.data[0]][0])
    assert header.parameters == sum(int(t.n_elements) for t in reference.tensors)
    assert read_header(path) is header


def test_header_reader_refuses_what_is_not_gguf(tmp_path):
    """A truncated header or another file is a clear error, never a wrong guess."""
    from engines.ggufmeta import GGUFFormatError, read_header

    whole = (Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:4096])
    with pytest.raises(GGUFFormatError):
        read_header(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFFormatError):
        read_header(other)
