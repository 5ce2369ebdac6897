"""Estimates of a model's memory before it is loaded (residency decisions use
them until a load has measured the real figure). No ML library: GGUF metadata is
read by engines/ggufmeta.py, everything else from file sizes and configs."""

import json
from pathlib import Path

from .config import ModelSpec
from .ggufmeta import read_header

MIB = 2**20
KV_BYTES = 2  # llama.cpp and transformers keep K and V in 16-bit here
DEFAULT_CONTEXT = 2048


def _gguf_shape(path: Path) -> dict:
    header = read_header(path)
    arch = str(header.get("general.architecture", ""))

    def value(key: str, default=None):
        found = header.get(f"{arch}.{key}")
        return default if found is None else int(found)

    layers = value("block_count", 0)
    embd = value("embedding_length", 0)
    heads = value("attention.head_count", 1) or 1
    kv_heads = value("attention.head_count_kv", heads) or heads
    head_dim = value("attention.key_length", embd // heads)
    return {
        "layers": layers,
        "kv_width": kv_heads * head_dim,
        "trained_context": value("context_length", DEFAULT_CONTEXT),
        "parameters": header.parameters,
    }


def _kv_mib(shape: dict, tokens: int) -> float:
    return 2 * shape["layers"] * shape["kv_width"] * tokens * KV_BYTES / MIB


def _files_mib(path: Path, suffixes: tuple[str, ...]) -> float:
    files = [path] if path.is_file() else path.rglob("*")
    return sum(f.stat().st_size for f in files if f.suffix in suffixes) / MIB


def estimate_model_mib(spec: ModelSpec, *, slots: int) -> float:
    """Weights plus the KV cache for the configured context on every slot."""
    path = Path(spec.path)
    if spec.format == "gguf":
        shape = _gguf_shape(path)
        context = min(spec.context_length or DEFAULT_CONTEXT, shape["trained_context"])
        return path.stat().st_size / MIB + _kv_mib(shape, context * slots)
    if spec.format == "transformers" and path.suffix == ".gguf":
        # transformers dequantizes a GGUF to float32 weights.
        shape = _gguf_shape(path)
        context = min(spec.context_length or DEFAULT_CONTEXT, shape["trained_context"])
        return shape["parameters"] * 4 / MIB + _kv_mib(shape, context * slots)
    if spec.format == "transformers":
        weights = _files_mib(path, (".safetensors", ".bin"))
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        stored = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        if "16" in stored:
            weights *= 2  # loaded as float32
        heads = config.get("num_attention_heads", 1)
        shape = {
            "layers": config.get("num_hidden_layers", 0),
            "kv_width": config.get("num_key_value_heads", heads)
            * config.get("head_dim", config.get("hidden_size", 0) // heads),
        }
        context = spec.context_length or DEFAULT_CONTEXT
        return weights + _kv_mib(shape, context * slots)
    return _files_mib(path, (".safetensors", ".bin"))  # an embedder's weights
