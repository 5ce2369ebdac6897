"""Where and in what precision a transformers model loads: a pure plan from the
checkpoint's facts (its own dtype, parameters, KV shape), the engine's backend
and its cards as plain data (engines/backends/hf.py learns them from torch at
load time), and the model's settings (ModelSpec.dtype, max_gpu_percent). No
torch here: the plan is tested, and readable, without it."""

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engines.backends.ggufmeta import read_header
from engines.backends.memory import MIB, config_shape, gguf_shape
from engines.launch.config import DTYPES

GIB = 1024  # MiB
# Backends torch runs models on ("cuda" is also how torch names ROCm cards);
# a Vulkan engine's transformers models run on the CPU.
TORCH_GPU_BACKENDS = frozenset({"cuda", "rocm"})
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A card with less room than this under the model's cap holds no part of it.
MIN_CARD_MIB = 512
# llama.cpp's general.file_type for unquantized files (others are quantized).
GGUF_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


@dataclass(frozen=True)
class Card:
    """One card as torch numbers it (CUDA_VISIBLE_DEVICES applied): its memory
    and whether it computes in bfloat16 (NVIDIA: compute capability 8.0 or
    later; ROCm: the cards torch supports)."""

    index: int
    name: str
    total_mib: float
    free_mib: float
    bf16: bool

    @property
    def label(self) -> str:
        return f"card {self.index} ({self.name})" if self.name else f"card {self.index}"


@dataclass(frozen=True)
class Checkpoint:
    """What the plan needs of a model's files: the dtype it is stored in (None:
    quantized or not said), its parameters, and its KV values per token."""

    dtype: str | None
    parameters: int
    kv_per_token: int = 0  # keys and values over every layer


@dataclass(frozen=True)
class Placement:
    """How to load: the torch dtype's name, transformers' `device_map` ("cpu",
    "cuda:N" or "auto"), accelerate's `max_memory` (bytes per card index and
    "cpu"; only with "auto"), what is expected off the cards, why, and what
    is unwise about the settings."""

    dtype: str
    device_map: str
    max_memory: dict[int | str, int] = field(default_factory=dict)
    weights_mib: float = 0.0
    offload_mib: float = 0.0
    reason: str = ""
    warnings: tuple[str, ...] = ()

    @property
    def on_gpu(self) -> bool:
        return self.device_map != "cpu"

    @property
    def text(self) -> str:
        """The reason and the warnings in one line."""
        return "; ".join([self.reason, *self.warnings])

    def load_kwargs(self) -> dict:
        """from_pretrained's placement arguments (the dtype as its name)."""
        kwargs: dict = {"dtype": self.dtype, "device_map": self.device_map}
        if self.max_memory:
            kwargs["max_memory"] = dict(self.max_memory)
        return kwargs

    def describe(self) -> dict:
        return {
            "dtype": self.dtype,
            "device_map": self.device_map,
            "max_memory_mib": {
                str(key): round(value / MIB, 1)
                for key, value in self.max_memory.items()
            },
            "weights_mib": round(self.weights_mib, 1),
            "offload_mib": round(self.offload_mib, 1),
            "reason": self.reason,
            "warnings": list(self.warnings),
        }


def _gib(mib: float) -> str:
    return f"{mib / GIB:.1f} GiB"


def _cpu_dtype(dtype: str) -> tuple[str, tuple[str, ...]]:
    if dtype == "auto":
        return "float32", ()
    if dtype == "float16":
        return dtype, (
            "float16 on the CPU is slow and some operations lack it: float32 "
            "(or bfloat16, to halve the memory) serves better there",
        )
    if dtype == "bfloat16":
        return dtype, ("bfloat16 on the CPU is slower than float32 on most CPUs",)
    return dtype, ()


def _gpu_dtype(
    dtype: str, own: str | None, cards: Sequence[Card]
) -> tuple[str, tuple[str, ...]]:
    without_bf16 = [card.label for card in cards if not card.bf16]
    if dtype == "auto":
        if own in ("float32", "float16"):
            return own, ()
        # bfloat16 (or a quantized file, dequantized to 16 bits)
        return ("float16" if without_bf16 else "bfloat16"), ()
    warnings = []
    if dtype == "bfloat16" and without_bf16:
        warnings.append(
            f"{', '.join(without_bf16)} has no bfloat16: emulated and slow; "
            "float16 (or auto) suits it"
        )
    if dtype == "float16" and own == "bfloat16":
        warnings.append(
            "float16 from a bfloat16 checkpoint can overflow (non-finite logits)"
        )
    return dtype, tuple(warnings)


def planned_dtype(*, backend: str, dtype: str, checkpoint_dtype: str | None) -> str:
    """The dtype a load takes before the cards are known (memory estimates):
    plan_placement's choice on cards that all have bfloat16 (float16 in their
    stead is the same size)."""
    if backend in TORCH_GPU_BACKENDS:
        return _gpu_dtype(dtype, checkpoint_dtype, ())[0]
    return _cpu_dtype(dtype)[0]


def plan_placement(
    *,
    backend: str,
    cards: Sequence[Card],
    checkpoint: Checkpoint,
    dtype: str = "auto",
    max_gpu_percent: int = 90,
    kv_tokens: int = 0,
    cpu_free_mib: float | None = None,
) -> Placement:
    """The dtype: the setting; "auto" is float32 on the CPU (half precision is
    slow there) and the checkpoint's own on a GPU, bfloat16 as float16 where
    a card lacks it. The place: the CPU on a CPU (or Vulkan) engine, or one
    with no card that has MIN_CARD_MIB under its cap; else each usable card
    may hold max_gpu_percent of its total (at most what is free), weights and
    the KV of `kv_tokens` together, split in proportion (a card keeps the KV
    of the layers it holds); one card that holds it all is "cuda:N",
    anything else accelerate's "auto" map over every usable card with those
    caps, and what they cannot hold offloaded to the CPU."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if not 1 <= max_gpu_percent <= 100:
        raise ValueError(f"max_gpu_percent must be 1 to 100, not {max_gpu_percent}")
    if checkpoint.parameters < 0 or kv_tokens < 0:
        raise ValueError("parameters and KV tokens cannot be negative")
    gpu = backend in TORCH_GPU_BACKENDS
    caps = {
        card.index: min(card.total_mib * max_gpu_percent / 100, card.free_mib)
        for card in cards
    }
    usable = [card for card in cards if caps[card.index] >= MIN_CARD_MIB]
    if not gpu or not usable:
        chosen, warnings = _cpu_dtype(dtype)
        why = ""
        if backend == "vulkan":
            why = " (torch has no Vulkan backend)"
        elif gpu and not cards:
            why = " (torch sees no card)"
        elif gpu:
            why = (
                f" (no card has {MIN_CARD_MIB} MiB free within "
                f"{max_gpu_percent}% of it)"
            )
        weights = checkpoint.parameters * DTYPE_BYTES[chosen] / MIB
        return Placement(
            chosen,
            "cpu",
            weights_mib=weights,
            reason=f"{chosen} on the CPU{why}",
            warnings=warnings,
        )
    chosen, warnings = _gpu_dtype(dtype, checkpoint.dtype, usable)
    size = DTYPE_BYTES[chosen]
    weights = checkpoint.parameters * size / MIB
    kv = checkpoint.kv_per_token * kv_tokens * size / MIB
    skipped = [card.label for card in cards if card not in usable]
    note = f" ({', '.join(skipped)} too full)" if skipped else ""
    bf16_note = ""
    if dtype == "auto" and chosen == "float16" and checkpoint.dtype != "float16":
        bf16_note = " (a card lacks bfloat16)"
    if len(usable) == 1 and weights + kv <= caps[usable[0].index]:
        card = usable[0]
        return Placement(
            chosen,
            f"cuda:{card.index}",
            weights_mib=weights,
            reason=(
                f"{chosen}{bf16_note} on {card.label}: {_gib(weights + kv)} of the "
                f"{_gib(caps[card.index])} allowed ({max_gpu_percent}%){note}"
            ),
            warnings=warnings,
        )
    share = weights / (weights + kv) if weights + kv else 1.0
    budgets = {card.index: caps[card.index] * share for card in usable}
    offload = max(weights - sum(budgets.values()), 0.0)
    cpu_room = weights if cpu_free_mib is None else cpu_free_mib
    if cpu_free_mib is not None and offload > cpu_free_mib:
        warnings += (
            f"the CPU has {_gib(cpu_free_mib)} free for the {_gib(offload)} "
            "offloaded: the load may fail",
        )
    max_memory: dict[int | str, int] = {
        index: int(budget * MIB) for index, budget in budgets.items()
    }
    max_memory["cpu"] = int(max(cpu_room, 0.0) * MIB)
    where = (
        f"over {len(usable)} cards, at most {max_gpu_percent}% of each"
        if len(usable) > 1
        else f"on {usable[0].label}, at most {max_gpu_percent}% of it"
    )
    reason = f"{chosen}{bf16_note} {where}{note}"
    if offload:
        reason += f"; {_gib(offload)} offloaded to the CPU"
    return Placement(
        chosen,
        "auto",
        max_memory,
        weights_mib=weights,
        offload_mib=offload,
        reason=reason,
        warnings=warnings,
    )


def _safetensors_parameters(files: list[Path]) -> int:
    """Parameters from safetensors headers (8 bytes of length, then JSON)."""
    total = 0
    for file in files:
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        total += sum(
            math.prod(info["shape"])
            for name, info in header.items()
            if name != "__metadata__"
        )
    return total


def read_checkpoint(path: Path | str) -> Checkpoint:
    """A checkpoint's facts without loading it: a folder's config.json and
    safetensors headers (else its .bin files' size), or a GGUF header."""
    path = Path(path)
    if path.suffix == ".gguf":
        header = read_header(path)
        shape = gguf_shape(header)
        file_type = header.get("general.file_type")
        return Checkpoint(
            GGUF_FILE_DTYPES.get(int(file_type)) if file_type is not None else None,
            header.parameters,
            2 * shape["layers"] * shape["kv_width"],
        )
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    stored = config.get("dtype") or config.get("torch_dtype")
    own = stored if stored in DTYPE_BYTES else None
    files = sorted(path.glob("*.safetensors"))
    if files:
        parameters = _safetensors_parameters(files)
    else:
        size = sum(file.stat().st_size for file in path.glob("*.bin"))
        parameters = size // DTYPE_BYTES.get(own or "float32", 4)
    shape = config_shape(config)
    return Checkpoint(own, parameters, 2 * shape["layers"] * shape["kv_width"])
