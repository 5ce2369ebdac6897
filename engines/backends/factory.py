"""Which models an engine holds: loading (once, whoever asks), leases, making
room by evicting idle models (memory and models-max), drains, keep-alive expiry,
and the one decode thread the generation models share."""

from engines.backends.memory import plan_slots
from engines.launch.config import GPU_BACKENDS, Limits, ModelSpec
from engines.wire.errors import ErrorCode, ProtocolError


def load_backend(spec: ModelSpec, backend: str, limits: Limits):
    """Construct a model backend with its slot plan, as a load does (imports
    the ML library on first use); engines.inspection.probe measures a model
    through it."""
    if spec.format == "embedding":
        from engines.backends.embedding import EmbeddingBackend

        return EmbeddingBackend(
            spec.path, backend=backend, batch_size=spec.max_batch_size
        )
    plan = plan_slots(spec, limits)
    generation = {
        "n_slots": plan.slots,
        "context_length": plan.context,
        "pool_tokens": plan.pool_tokens,
        "n_threads": limits.threads or None,
        "chat_template": spec.chat_template,
        "prompt_cache": spec.prompt_cache,
    }
    if spec.format == "gguf":
        from engines.backends.gguf import LlamaBackend

        gpu = backend in GPU_BACKENDS
        loaded = LlamaBackend(
            spec.path, gpu=gpu, kv_groups=plan.kv_groups, **generation
        )
    elif spec.format == "transformers":
        from engines.backends.hf import TransformersBackend

        device = "cuda" if backend in ("cuda", "rocm") else "cpu"
        loaded = TransformersBackend(spec.path, device=device, **generation)
    else:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"model {spec.name!r} has format {spec.format!r}, which engines do "
            "not serve",
        )
    loaded.plan = plan
    return loaded
