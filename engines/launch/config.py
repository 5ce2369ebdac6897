"""What an engine is told at spawn and by `configure`: one typed schema for
both sides. The supervisor builds an `EngineConfig` (and, for a running
engine, a `LiveConfig`) and the engine reads it back with `from_dict`, which
refuses unknown keys, missing required keys and values of the wrong type with
a ValueError (pydantic's ValidationError) naming each by its place; a key
that has a default may be left out. No Django here. The environment variables
an engine reads are engines/launch/environment.py."""

import json
import os
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
)

from engines.launch.environment import CONFIG_ENV, config_from_environment

# Backends whose models live in device memory.
GPU_BACKENDS = frozenset({"cuda", "rocm", "vulkan"})

LOOPBACK = "127.0.0.1"

# The context from_dict validates with: the JSON form (models as a list).
JSON_FORM = {"form": "json"}

# What a chat longer than a model's context gets (engines/generation/context.py).
CONTEXT_OVERFLOW = ("refuse", "drop_oldest")
# A model's weights on the engine's GPUs (GGUF): planned from the cards' free
# memory ("auto"), every layer ("all"), none ("none"), or a number of layers.
GPU_LAYERS_WORDS = ("auto", "all", "none")
# A transformers model's precision: its own ("auto": the checkpoint's dtype,
# bfloat16/float16 on a GPU that has it, float32 on the CPU) or this one.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def gpu_layers_problem(value: str) -> str | None:
    """Why `value` is not a GPU layers setting, or None."""
    if value in GPU_LAYERS_WORDS or (value.isdigit() and int(value) <= 100_000):
        return None
    return f"must be one of {', '.join(GPU_LAYERS_WORDS)} or a number of layers"


def tensor_split_problem(value: str) -> str | None:
    """Why `value` is not a split over cards ("" or shares such as "3,1",
    one per card in order), or None."""
    if not value:
        return None
    try:
        shares = [float(part) for part in value.split(",")]
    except ValueError:
        shares = []
    if (
        not shares
        or len(shares) > 16
        or any(not share >= 0 for share in shares)
        or not sum(shares) > 0
    ):
        return "must be shares per card, e.g. 3,1 (up to 16, not all 0)"
    return None


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a pinned engine or a
    container's cpuset), which os.cpu_count() ignores."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


class Schema(BaseModel):
    """A block of an engine's configuration: unknown keys refused, values
    of the wrong type refused rather than converted (an int is a float, a
    bool is no number); assignable, as the engine changes its running
    configuration in place (LiveConfig.apply)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @classmethod
    def from_dict(cls, data: Any):
        """The block from its JSON form; ValueError naming what is wrong."""
        return cls.model_validate(data, context=JSON_FORM)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what from_dict reads back)."""
        return self.model_dump(mode="json")


class Limits(Schema):
    """Admission limits, pushed again by `configure` when the admin changes."""

    max_parallel_requests: int = 32
    # The most slots a model with `auto` slots gets (engines/backends/memory.py).
    max_slots_per_model: int = 32
    # Memory for a generation model's KV pool, which its slots share (1.5 GiB:
    # SmolLM2's 32 auto slots of 2,048 tokens each hold their whole context,
    # a KV stream each; engines/backends/memory.py).
    kv_cache_mib: int = 1536
    queue_limit: int = 64
    queue_timeout_s: float = 60.0
    models_max: int = 3
    memory_margin_mib: int = 512
    threads: int = 0  # compute threads per model; 0: one per core
    # The decode loop with work to do and no pass for this long is stuck: the
    # engine reports itself unhealthy and the supervisor replaces it.
    stuck_after_s: float = 60.0


class ModelSpec(Schema):
    """One model an engine may load: where it is and how it is served."""

    name: str
    format: str
    path: str
    task: str = "embedding"
    batch_window_ms: float = 5.0
    max_batch_size: int = 64
    keep_alive_s: int = 300
    context_length: int | None = None
    slots: int | None = None  # None: auto, sized by memory (engines/backends/memory.py)
    # Memory measured after an earlier load (the supervisor stores it in the
    # catalog); used instead of the estimate when known.
    measured_mib: float | None = None
    measured_device_mib: float | None = None  # the same, on the engine's GPUs
    sampling: dict[str, Any] = Field(default_factory=dict)
    chat_template: str = ""
    # Keep each slot's KV between requests, reused for a prompt that starts
    # the same way (engines/generation/slot_pool.py).
    prompt_cache: bool = True
    # A chat longer than the context: "refuse" or "drop_oldest" turns
    # (engines/generation/context.py).
    context_overflow: str = "refuse"
    # GGUF on a GPU engine: layers on its cards (GPU_LAYERS_WORDS or a
    # number), and how they are split over several cards ("": by free memory).
    gpu_layers: str = "auto"
    tensor_split: str = ""
    # Transformers: the precision (DTYPES), and the share of each card's
    # memory the model may take (accelerate's max_memory).
    dtype: str = "auto"
    max_gpu_percent: int = Field(default=90, ge=1, le=100)

    @field_validator("context_overflow")
    @classmethod
    def _known_overflow(cls, value: str) -> str:
        if value not in CONTEXT_OVERFLOW:
            raise ValueError(f"must be one of {CONTEXT_OVERFLOW}, not {value!r}")
        return value

    @field_validator("gpu_layers")
    @classmethod
    def _known_gpu_layers(cls, value: str) -> str:
        problem = gpu_layers_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("tensor_split")
    @classmethod
    def _known_split(cls, value: str) -> str:
        problem = tensor_split_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"must be one of {DTYPES}, not {value!r}")
        return value


class VendorThresholds(Schema):
    """One GPU vendor's pause/resume temperatures (°C), instead of the defaults."""

    high: float
    resume: float


class Thresholds(Schema):
    """Pause/resume temperatures (°C): the CPU's, the GPUs' defaults, and
    per-vendor GPU overrides. engines/runtime/thermal.py judges each reading by
    `for_device`: work pauses at `high` and resumes only below `resume`."""

    cpu_high: float = 90
    cpu_resume: float = 80
    gpu_high: float = 85
    gpu_resume: float = 75
    overrides: dict[str, VendorThresholds] = Field(default_factory=dict)

    def for_device(self, kind: str, vendor: str) -> tuple[float, float]:
        """(high, resume) for a device: "cpu", or a "gpu" of `vendor`."""
        if kind == "cpu":
            return self.cpu_high, self.cpu_resume
        override = self.overrides.get(vendor)
        if override is not None:
            return override.high, override.resume
        return self.gpu_high, self.gpu_resume


def _models_by_name(items: Any, info: ValidationInfo) -> Any:
    """The JSON form's list of models, keyed by name for validation (each
    then checked as a ModelSpec, an error placed at models.<name>.<key>);
    two with one name refused. Built in Python, a dict by name as it is."""
    if (
        isinstance(items, dict)
        and info.context is not JSON_FORM
        and all(isinstance(spec, ModelSpec) for spec in items.values())
    ):
        return items
    if not isinstance(items, list):
        raise ValueError("models must be a list")
    keyed = {}
    for index, item in enumerate(items):
        name = item.get("name") if isinstance(item, dict) else None
        key = name if isinstance(name, str) else str(index)
        if key in keyed:
            raise ValueError("two models share a name")
        keyed[key] = item
    return keyed


def _models_listed(models: dict[str, ModelSpec] | None) -> list | None:
    if models is None:
        return None
    return [model.model_dump(mode="json") for model in models.values()]


class EngineConfig(Schema):
    """Everything an engine process needs to start. In its JSON form the
    models are a list; here, a dict by name."""

    name: str
    port: int
    backend: str = "cpu"
    limits: Limits = Field(default_factory=Limits)
    models: dict[str, ModelSpec] = Field(default_factory=dict)
    preload: list[str] = Field(default_factory=list)
    # Thermal thresholds, and the GPUs this engine owns (UUIDs or indices):
    # only those pause it (engines/runtime/thermal.py).
    thermal: Thresholds = Field(default_factory=Thresholds)
    devices: list[str] = Field(default_factory=list)
    # CPU cores the process may run on (set when it starts); empty: all.
    cpus: list[int] = Field(default_factory=list)

    @field_validator("models", mode="before")
    @classmethod
    def _models_read(cls, items: Any, info: ValidationInfo) -> Any:
        return _models_by_name(items, info)

    @field_serializer("models")
    def _models_json(self, models: dict[str, ModelSpec]) -> list:
        return _models_listed(models)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_env(cls) -> "EngineConfig":
        """The configuration the supervisor handed over: the JSON in CONFIG_ENV,
        or in the file CONFIG_FILE_ENV names (deleted once read)."""
        raw = config_from_environment()
        if not raw:
            raise SystemExit(
                f"{CONFIG_ENV} is not set: engines are started by `manage.py supervise`"
            )
        return cls.from_dict(json.loads(raw))


class LiveConfig(Schema):
    """What `configure` changes in a running engine: the supervisor pushes it
    when the admin changes these (the rest of EngineConfig needs a restart).
    The configure request carries it typed (engines/wire/requests.py). A
    setting left out (None) stays as it runs; a limits block given in part
    takes the defaults for the rest."""

    limits: Limits | None = None
    models: dict[str, ModelSpec] | None = None
    thermal: Thresholds | None = None
    devices: list[str] | None = None

    @field_validator("models", mode="before")
    @classmethod
    def _models_read(cls, items: Any, info: ValidationInfo) -> Any:
        return None if items is None else _models_by_name(items, info)

    @field_serializer("models")
    def _models_json(self, models: dict[str, ModelSpec] | None) -> list | None:
        return _models_listed(models)

    @classmethod
    def of(cls, config: EngineConfig) -> "LiveConfig":
        """Every live setting of a whole configuration."""
        return cls(
            limits=config.limits,
            models=dict(config.models),
            thermal=config.thermal,
            devices=list(config.devices),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the settings given, none for those left out."""
        return self.model_dump(mode="json", exclude_none=True)

    def apply(self, config: EngineConfig) -> None:
        """Change a running configuration in place: each setting given
        replaces its value."""
        if self.limits is not None:
            config.limits = self.limits
        if self.models is not None:
            config.models = self.models
        if self.thermal is not None:
            config.thermal = self.thermal
        if self.devices is not None:
            config.devices = self.devices
