"""A model's backend made as a load makes it: its slot plan, and on a GPU
engine where its weights go (a GGUF model's layers over the cards and the
CPU: offload.py; a transformers model's precision and device map:
hf_placement.py, planned where it loads)."""

from collections.abc import Sequence

from engines.backends.ggufmeta import read_header
from engines.backends.memory import SlotPlan, gguf_layer_sizes, plan_slots
from engines.backends.offload import Card, OffloadPlan, plan_offload
from engines.launch.config import GPU_BACKENDS, Limits, ModelSpec
from engines.launch.devices import CardMemory, DeviceMemory
from engines.launch.environment import cuda_visible_devices
from engines.wire.errors import ErrorCode, ProtocolError


def card_label(card: CardMemory, place: int) -> str:
    """How a card is named in plans: `gpu-N` by its index where a probe
    gives one (nvidia-smi, sysfs), else its name (a UUID, a file's id)."""
    index = sorted(name for name in card.names if name.isdigit())
    if index:
        return f"gpu-{index[0]}"
    return min(card.names, default=f"gpu-{place}")


def visible_cards(backend: str) -> list[str] | None:
    """The cards CUDA shows this process (CUDA_VISIBLE_DEVICES) on a CUDA
    engine; None elsewhere, or when every card is visible."""
    return cuda_visible_devices() if backend == "cuda" else None


def offload_cards(memory: DeviceMemory, visible: list[str] | None = None) -> list[Card]:
    """The cards an engine owns as offload planning sees them: a label, the
    free memory, and the card's device number in llama.cpp. Where
    CUDA_VISIBLE_DEVICES names the cards (`visible`, by index or UUID), that
    number is the card's place in the list, and a card not in it is left out
    (the engine cannot use it); else its place among every card the probes
    see (their PCI bus order, which CUDA follows: engines start with
    CUDA_DEVICE_ORDER=PCI_BUS_ID). Runs the probes (nvidia-smi may be slow):
    call it off the event loop."""
    every = [card for probe in memory.probes for card in probe.read()]
    cards = []
    for place, card in enumerate(every):
        if memory.devices and not card.names & memory.devices:
            continue
        if visible is not None:
            shown = [
                number for number, name in enumerate(visible) if name in card.names
            ]
            if not shown:
                continue
            place = shown[0]
        cards.append(Card(card_label(card, place), card.free_mib, place))
    return cards


def plan_gguf_offload(
    spec: ModelSpec,
    slots: SlotPlan,
    backend: str,
    limits: Limits,
    cards: Sequence[Card] | None,
    host_free_mib: float | None = None,
) -> OffloadPlan:
    """The offload plan of a GGUF model served as `slots` says: none of its
    layers on a CPU engine; on a GPU engine, over `cards` as the model's
    settings say (cards None: their memory unknown, as for a probe of the
    files: one card taken to hold the whole model)."""
    sizes = gguf_layer_sizes(read_header(spec.path), slots)
    if backend not in GPU_BACKENDS:
        cards = []
    elif cards is None:
        cards = [Card("gpu", sizes.total_mib + limits.memory_margin_mib)]
    return plan_offload(
        sizes,
        cards,
        margin_mib=limits.memory_margin_mib,
        gpu_layers=spec.gpu_layers,
        tensor_split=spec.tensor_split,
        host_free_mib=host_free_mib,
    )


def load_backend(
    spec: ModelSpec,
    backend: str,
    limits: Limits,
    *,
    cards: Sequence[Card] | None = None,
    host_free_mib: float | None = None,
):
    """Construct a model backend with its slot plan, as a load does (imports
    the ML library on first use); engines.inspection.probe measures a model
    through it. A GGUF model on a GPU engine gets its offload plan from
    `cards` (offload_cards) and is refused before it loads when the plan
    fits nowhere (`host_free_mib`: the host's available memory)."""
    if spec.format == "embedding" and spec.task == "rerank":
        from engines.backends.cross_encoder import CrossEncoderBackend

        return CrossEncoderBackend(
            spec.path, backend=backend, batch_size=spec.max_batch_size
        )
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
        try:
            offload = plan_gguf_offload(
                spec, plan, backend, limits, cards, host_free_mib
            )
        except (OSError, ValueError) as error:  # its header: not a GGUF file
            raise ProtocolError(
                ErrorCode.INTERNAL, f"llama.cpp cannot load {spec.path}: {error}"
            ) from None
        if not offload.fits:
            raise ProtocolError(
                ErrorCode.INSUFFICIENT_MEMORY, f"{spec.name}: {offload.reason}"
            )
        from engines.backends.gguf import LlamaBackend

        loaded = LlamaBackend(
            spec.path,
            offload=offload,
            kv_groups=plan.kv_groups,
            kv_streams=plan.kv_streams,
            **generation,
        )
    elif spec.format == "transformers":
        from engines.backends.hf import TransformersBackend

        loaded = TransformersBackend(
            spec.path,
            backend=backend,
            dtype=spec.dtype,
            max_gpu_percent=spec.max_gpu_percent,
            **generation,
        )
    else:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"model {spec.name!r} has format {spec.format!r}, which engines do "
            "not serve",
        )
    loaded.plan = plan
    return loaded
