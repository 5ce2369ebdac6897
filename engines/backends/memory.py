"""Estimates of a model's memory before it is loaded (residency decisions use
them until a load has measured the real figure). No ML library: GGUF metadata is
read by engines/backends/ggufmeta.py, everything else from file sizes and configs."""

import json
from dataclasses import dataclass
from pathlib import Path

from engines.backends.ggufmeta import GGUFHeader, read_header
from engines.backends.offload import LayerSizes
from engines.launch.config import Limits, ModelSpec

MIB = 2**20
KV_BYTES = 2  # llama.cpp and transformers keep K and V in 16-bit here
# A generation model's context when its setting is empty (its trained one, if
# shorter).
DEFAULT_CONTEXT = 4096
# Auto slots: one per this many tokens of the KV pool.
AUTO_SLOT_TOKENS = 1024
# A GGUF model's slots are split over up to this many llama.cpp contexts (KV
# groups; engines/backends/gguf.py says why), each of at least
# GROUP_MIN_SLOTS slots and GROUP_MIN_CONTEXTS whole contexts of the pool.
MAX_KV_GROUPS = 4
GROUP_MIN_SLOTS = 4
GROUP_MIN_CONTEXTS = 2
# Prompt tokens llama.cpp evaluates per step (its n_batch and n_ubatch, set by
# engines/backends/gguf.py): its compute buffer holds a step's activations.
BATCH_TOKENS = 512


def _gguf_shape(path: Path) -> dict:
    return gguf_shape(read_header(path))


def gguf_shape(header: GGUFHeader) -> dict:
    """Layers, KV width, trained context and parameters, from a GGUF header
    (read from a file here, or from one not downloaded yet)."""
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
        "embedding": embd,
        "heads": heads,
        "vocabulary": header.vocabulary,
        "kv_width": kv_heads * head_dim,
        "trained_context": value("context_length", DEFAULT_CONTEXT),
        "parameters": header.parameters,
    }


def _kv_mib(shape: dict, tokens: int) -> float:
    return 2 * shape["layers"] * shape["kv_width"] * tokens * KV_BYTES / MIB


def gguf_compute_mib(shape: dict, kv_tokens: int, *, logits: bool = True) -> float:
    """llama.cpp's compute buffer (float32 scratch) for one context holding
    `kv_tokens` of KV, without flash attention: a step of BATCH_TOKENS needs
    the larger of its attention scores over the whole KV and its output
    logits (Ollama's graph-size rule; measured here within 2% of what
    llama.cpp reserves: SmolLM2-135M 99.4 MiB at 4,096 tokens and 326.4 MiB
    at 16,384, Gemma 3 270M 514.5 MiB at 4,096). Without `logits`: the
    attention's alone (a card that holds layers but not the output one)."""
    embd, heads = shape.get("embedding", 0), shape.get("heads", 1)
    attention = 1 + 4 * embd + kv_tokens * (1 + heads)
    output = embd + shape.get("vocabulary", 0) if logits else 0
    return 4 * BATCH_TOKENS * max(attention, output) / MIB


def _served_kv_tokens(shape: dict, context: int, slots: int, pool_tokens: int) -> int:
    """The tokens of KV served: `pool_tokens`, else `context` (the model's
    setting; else its trained context up to DEFAULT_CONTEXT) on every slot."""
    context = min(context or DEFAULT_CONTEXT, shape["trained_context"])
    return pool_tokens or context * slots


def _served_kv_mib(shape: dict, context: int, slots: int, pool_tokens: int) -> float:
    """The KV cache of _served_kv_tokens."""
    return _kv_mib(shape, _served_kv_tokens(shape, context, slots, pool_tokens))


def _files_mib(path: Path, suffixes: tuple[str, ...]) -> float:
    files = [path] if path.is_file() else path.rglob("*")
    return sum(f.stat().st_size for f in files if f.suffix in suffixes) / MIB


def _shape(spec: ModelSpec) -> dict:
    """Layers, KV width and trained context of a generation model's files."""
    path = Path(spec.path)
    if spec.format == "gguf" or path.suffix == ".gguf":
        return _gguf_shape(path)
    return config_shape(json.loads((path / "config.json").read_text(encoding="utf-8")))


def config_shape(config: dict) -> dict:
    """Layers, KV width and trained context from a transformers config.json."""
    heads = int(config.get("num_attention_heads") or 1)
    return {
        "layers": int(config.get("num_hidden_layers") or 0),
        "kv_width": int(config.get("num_key_value_heads") or heads)
        * int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads),
        "trained_context": int(
            config.get("max_position_embeddings") or DEFAULT_CONTEXT
        ),
    }


def transformers_estimate_mib(
    config: dict,
    weight_bytes: int,
    *,
    context: int = 0,
    slots: int = 1,
    pool_tokens: int = 0,
    loaded_dtype: str = "float32",
) -> float:
    """What a transformers model takes served: its weights as loaded (in
    `loaded_dtype`: hf_placement.planned_dtype; float32 by default, as a CPU
    engine loads them) plus its KV cache (_served_kv_mib). From a config and
    the weights' size read anywhere: on disk, or on the Hub before a pull."""
    stored = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    stored_bytes = 2 if "16" in stored else 4
    loaded_bytes = 2 if "16" in loaded_dtype else 4
    loaded = weight_bytes * loaded_bytes / stored_bytes
    kv = _served_kv_mib(config_shape(config), context, slots, pool_tokens)
    return loaded / MIB + kv


@dataclass(frozen=True)
class SlotPlan:
    """How a generation model is served: its slots, the tokens one conversation
    may hold (`context`), and the KV pool the slots share (`pool_tokens`,
    `kv_mib`), split in `kv_groups` equal groups of slots: one long
    conversation may use more than an equal share."""

    slots: int
    context: int
    pool_tokens: int
    kv_mib: float
    auto: bool
    kv_groups: int = 1
    # A GGUF model whose pool holds every slot's whole context: one context
    # with a KV stream per slot (llama.cpp's kv_unified off), no groups.
    kv_streams: bool = False

    def describe(self) -> dict:
        return {
            "slots": self.slots,
            "slots_auto": self.auto,
            "context": self.context,
            "kv_pool_tokens": self.pool_tokens,
            "kv_mib": round(self.kv_mib, 1),
            "kv_groups": self.kv_groups,
            "kv_streams": self.kv_streams,
        }


def plan_slots(spec: ModelSpec, limits: Limits) -> SlotPlan:
    """The model's slots and KV pool. Its context: its setting, else its trained
    context up to DEFAULT_CONTEXT. The pool: the KV budget's worth of tokens
    (Limits.kv_cache_mib), never less than one whole context nor more than
    every slot's whole context. Slots `auto` (the model's `slots` empty): one
    per AUTO_SLOT_TOKENS of the pool (a context, if shorter), up to the cap
    (Limits.max_slots_per_model), at least one. A GGUF model's KV groups: as
    many as leave each group GROUP_MIN_SLOTS slots and GROUP_MIN_CONTEXTS
    contexts of the pool, up to MAX_KV_GROUPS (so a conversation can still
    hold its whole context, more than an equal share); but where the pool
    holds every slot's whole context, no groups: a KV stream per slot
    (`kv_streams`), each token's attention over its own conversation's
    cells alone, in one decode call a step. Reads file headers: run it off
    the event loop."""
    try:
        shape = _shape(spec)
    except (OSError, ValueError, KeyError):
        # Files that do not tell: the load itself says what is wrong with them.
        shape = {"layers": 0, "kv_width": 0, "trained_context": DEFAULT_CONTEXT}
    trained = shape["trained_context"] or DEFAULT_CONTEXT
    context = min(spec.context_length or min(trained, DEFAULT_CONTEXT), trained)
    per_token = _kv_mib(shape, 1)
    budget = int(limits.kv_cache_mib / per_token) if per_token else context
    slots = spec.slots
    if not slots:
        share = min(context, AUTO_SLOT_TOKENS)
        slots = max(1, min(limits.max_slots_per_model, budget // share))
    pool = max(context, min(budget, slots * context))
    groups, streams = 1, False
    if spec.format == "gguf" and slots > 1 and pool >= slots * context:
        streams = True
    elif spec.format == "gguf":
        by_pool = pool // (GROUP_MIN_CONTEXTS * context)
        groups = max(1, min(MAX_KV_GROUPS, slots // GROUP_MIN_SLOTS, by_pool))
    return SlotPlan(
        slots,
        context,
        pool,
        pool * per_token,
        auto=not spec.slots,
        kv_groups=groups,
        kv_streams=streams,
    )


def estimate_model_mib(
    spec: ModelSpec, *, slots: int = 1, pool_tokens: int = 0, backend: str = "cpu"
) -> float:
    """Weights plus the KV cache: `pool_tokens` (a SlotPlan's), else the
    configured context on every slot. A transformers model's weights in the
    precision a load on an engine of `backend` takes (hf_placement)."""
    path = Path(spec.path)
    if spec.format == "embedding":
        return _files_mib(path, (".safetensors", ".bin"))  # an embedder's weights
    if spec.format == "gguf":
        return gguf_estimate_mib(
            read_header(path),
            path.stat().st_size,
            context=spec.context_length,
            slots=slots,
            pool_tokens=pool_tokens,
        )
    if path.suffix == ".gguf":  # transformers dequantizes a GGUF to float32
        shape = _shape(spec)
        kv = _served_kv_mib(shape, spec.context_length, slots, pool_tokens)
        return shape["parameters"] * 4 / MIB + kv
    from engines.backends.hf_placement import planned_dtype  # it imports this

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    stored = config.get("dtype") or config.get("torch_dtype")
    return transformers_estimate_mib(
        config,
        int(_files_mib(path, (".safetensors", ".bin")) * MIB),
        context=spec.context_length,
        slots=slots,
        pool_tokens=pool_tokens,
        loaded_dtype=planned_dtype(
            backend=backend, dtype=spec.dtype, checkpoint_dtype=stored
        ),
    )


def gguf_estimate_mib(
    header: GGUFHeader,
    file_bytes: int,
    *,
    context: int = 0,
    slots: int = 1,
    pool_tokens: int = 0,
) -> float:
    """What a GGUF model takes served by llama.cpp: its file (the weights,
    mapped whole) plus the KV cache of `pool_tokens`, else of `context` (its
    setting; else its trained context up to DEFAULT_CONTEXT) on every slot,
    plus the compute buffer of a context holding that KV. The estimate
    residency uses, from a header read anywhere: before a download, through
    a ranged file (ggufmeta.read_header_from)."""
    shape = gguf_shape(header)
    kv = _served_kv_mib(shape, context, slots, pool_tokens)
    tokens = _served_kv_tokens(shape, context, slots, pool_tokens)
    return file_bytes / MIB + kv + gguf_compute_mib(shape, tokens)


def gguf_layer_sizes(header: GGUFHeader, plan: SlotPlan) -> LayerSizes:
    """A GGUF model's memory by where llama.cpp places it (offload planning,
    engines/backends/offload.py), served as `plan` says: each repeating
    layer's weights and its share of the KV pool, the input and output
    layers, and one compute buffer per KV group's context (each holds its
    share of the pool)."""
    shape = gguf_shape(header)
    layers = shape["layers"] or len(header.layer_bytes) or 1
    group_tokens = max(plan.pool_tokens // max(plan.kv_groups, 1), 1)
    return LayerSizes(
        blocks=tuple(size / MIB for size in header.layer_bytes),
        input_mib=header.input_bytes / MIB,
        output_mib=header.output_bytes / MIB,
        kv_per_layer_mib=_kv_mib(shape, plan.pool_tokens) / layers,
        compute_mib=plan.kv_groups * gguf_compute_mib(shape, group_tokens),
        layer_compute_mib=plan.kv_groups
        * gguf_compute_mib(shape, group_tokens, logits=False),
    )
