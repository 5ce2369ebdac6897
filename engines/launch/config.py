"""What an engine is told at spawn and by `configure`, and the environment
variables it reads (all of them, each commented, and read only here: the
functions below). No Django here: the supervisor serialises everything an
engine needs into these variables.

One typed schema for both sides: the supervisor builds an `EngineConfig` and the
engine reads it back with `from_dict`, which refuses unknown keys, missing
required keys and values of the wrong type with a ValueError naming them (a key
that has a default may be left out)."""

import contextlib
import json
import os
import types
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Union, get_args, get_origin

# ROUNDHOUSE_ENGINE_TOKEN: the per-run secret every request must carry. Only ever
# in the engine's environment (never argv, logs or the database); the engine
# removes it from os.environ once read so its own children do not inherit it.
TOKEN_ENV = "ROUNDHOUSE_ENGINE_TOKEN"  # noqa: S105 - a variable name
# ROUNDHOUSE_ENGINE_CONFIG: JSON of EngineConfig (name, port, backend, limits,
# model catalog). Not secret.
CONFIG_ENV = "ROUNDHOUSE_ENGINE_CONFIG"
# ROUNDHOUSE_ENGINE_CONFIG_FILE: instead of the above, the path of a 0600 file
# holding the same JSON, for a configuration too large for the environment (see
# MAX_ENV_STRING). The engine deletes the file once read.
CONFIG_FILE_ENV = "ROUNDHOUSE_ENGINE_CONFIG_FILE"
# ROUNDHOUSE_ENGINE_LIFELINE_FD: the read end of a pipe whose write end only the
# supervisor holds. It reads end-of-file when the supervisor dies, however it
# dies (SIGKILL included): the engine then stops as on SIGTERM. Unset: no watch
# (an engine started by a test or a benchmark).
LIFELINE_FD_ENV = "ROUNDHOUSE_ENGINE_LIFELINE_FD"
# Linux refuses to exec with one environment string ("KEY=value") longer than
# MAX_ARG_STRLEN (32 pages: 128 KiB); all of them together must also fit in
# ARG_MAX with the arguments. Checked before spawning, and in the admin.
MAX_ENV_STRING = 128 * 1024
# Engines never reach a model hub: weights come from the models directory.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
}

# ROUNDHOUSE_THERMAL_FILE: read temperatures from this JSON file instead of the
# machine's sensors (engines/runtime/thermal.py FileProbe). For machines without sensors
# and for tests; unset in production.
THERMAL_FILE_ENV = "ROUNDHOUSE_THERMAL_FILE"
# ROUNDHOUSE_DEVICE_MEMORY_FILE: read GPU memory (total, used) from this JSON file
# instead of nvidia-smi / sysfs (engines/launch/devices.py FileMemoryProbe). For
# machines without a GPU and for tests; unset in production.
DEVICE_MEMORY_FILE_ENV = "ROUNDHOUSE_DEVICE_MEMORY_FILE"
# What an engine (and a one-shot tool: engines/inspection/messages.py) inherits from the
# process that starts it: only these variables, never the whole environment,
# which holds the web side's secrets (DATABASE_URL, REDIS_URL and its password,
# SECRET_KEY, ...). The process basics, the math libraries' thread counts, the
# GPU runtimes' device selection and the ML libraries' cache and offline
# settings; the spec's env block and the engine's own variables (its config,
# token, lifeline) are added on top.
INHERITED_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TEMP",
        "TMP",
        "SYSTEMROOT",  # Windows needs it to start Python at all
        "LD_LIBRARY_PATH",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONFAULTHANDLER",
        "PYTHONWARNINGS",
        "XDG_CACHE_HOME",
        "TOKENIZERS_PARALLELISM",
        "SENTENCE_TRANSFORMERS_HOME",
        THERMAL_FILE_ENV,
        DEVICE_MEMORY_FILE_ENV,
    }
)
INHERITED_ENV_PREFIXES = (
    "LC_",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "CUDA_",
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "HSA_",
    "VK_",
    "GGML_",
    "LLAMA_",
    "TORCH_",
    "PYTORCH_",
    "HF_",
    "TRANSFORMERS_",
)
# Hub credentials: engines never reach a hub (OFFLINE_ENV).
NEVER_INHERITED_ENV = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})


def inherited_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The variables of `base` an engine or a tool is given (INHERITED_ENV)."""
    return {
        key: value
        for key, value in base.items()
        if (key in INHERITED_ENV or key.startswith(INHERITED_ENV_PREFIXES))
        and key not in NEVER_INHERITED_ENV
    }


def offline_environment_set() -> None:
    """Put OFFLINE_ENV in this process's environment where a variable is not
    set already (the ML libraries read it when they are imported)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def token_from_environment() -> str:
    """TOKEN_ENV, removed from os.environ once read so that the engine's own
    children do not inherit it; empty when unset."""
    return os.environ.pop(TOKEN_ENV, "")


def lifeline_fd_from_environment() -> int | None:
    """LIFELINE_FD_ENV, removed from os.environ once read (the engine's own
    children must not watch it); None when unset. ValueError: not a number."""
    value = os.environ.pop(LIFELINE_FD_ENV, "")
    return int(value) if value else None


def config_in_environment() -> bool:
    """Whether a configuration was handed over (CONFIG_ENV or CONFIG_FILE_ENV)."""
    return bool(os.environ.get(CONFIG_ENV) or os.environ.get(CONFIG_FILE_ENV))


def thermal_file() -> str | None:
    """THERMAL_FILE_ENV: the temperature file to read instead of the sensors;
    None when unset or empty (read the sensors)."""
    return os.environ.get(THERMAL_FILE_ENV) or None


def device_memory_file() -> str | None:
    """DEVICE_MEMORY_FILE_ENV: the GPU memory file to read instead of
    nvidia-smi / sysfs; None when unset or empty (read the cards)."""
    return os.environ.get(DEVICE_MEMORY_FILE_ENV) or None


# Backends whose models live in device memory.
GPU_BACKENDS = frozenset({"cuda", "rocm", "vulkan"})

LOOPBACK = "127.0.0.1"


def arg_max() -> int:
    """Bytes exec accepts for arguments and environment together (ARG_MAX)."""
    try:
        return int(os.sysconf("SC_ARG_MAX"))
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return 32 * 1024


def env_problems(env: dict[str, str], *, budget: int | None = None) -> list[str]:
    """Why exec would refuse this environment, one line per variable: a NUL in
    a name or value, one "NAME=value" string over MAX_ENV_STRING bytes, or all
    of them together over `budget` bytes (default: ARG_MAX less 16 KiB for the
    command line). Empty: it can be passed."""
    problems = []
    total = 0
    for key, value in env.items():
        if "\0" in key or "\0" in value:
            problems.append(f"{key!r} contains a NUL character")
            continue
        size = len(f"{key}={value}".encode()) + 1
        if size > MAX_ENV_STRING:
            problems.append(
                f"{key} is {size:,} bytes; the system allows {MAX_ENV_STRING:,} "
                "per variable"
            )
        total += size + 8  # and its pointer
    budget = arg_max() - 16 * 1024 if budget is None else budget
    if total > budget:
        problems.append(
            f"the variables take {total:,} bytes together; at most {budget:,} fit"
        )
    return problems


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a pinned engine or a
    container's cpuset), which os.cpu_count() ignores."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def from_known_fields(cls, data: Any):
    """Build a dataclass from a dict of its fields, checked: a ValueError names
    unknown keys, missing required keys and values of the wrong type. Keys that
    have a default may be left out (a partial `configure` keeps the defaults)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object, not {_kind(data)}")
    schema = {item.name: item for item in fields(cls)}
    problems = []
    unknown = sorted(str(key) for key in data if key not in schema)
    if unknown:
        problems.append(f"unknown keys {', '.join(unknown)}")
    missing = [
        name
        for name, item in schema.items()
        if name not in data
        and item.default is MISSING
        and item.default_factory is MISSING
    ]
    if missing:
        problems.append(f"missing keys {', '.join(missing)}")
    wrong = [
        f"{name} is {_kind(value)}, not {_type_name(schema[name].type)}"
        for name, value in data.items()
        if name in schema and not _conforms(value, schema[name].type)
    ]
    problems += wrong
    if problems:
        raise ValueError(f"{cls.__name__}: {'; '.join(problems)}")
    return cls(**data)


def _conforms(value: Any, kind: Any) -> bool:
    """Whether a JSON value fits a field's annotation (an int fits a float)."""
    origin = get_origin(kind)
    if kind is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_conforms(value, arg) for arg in get_args(kind))
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = get_args(kind)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is dict:
        key, item = get_args(kind)
        return isinstance(value, dict) and all(
            _conforms(k, key) and _conforms(v, item) for k, v in value.items()
        )
    return isinstance(value, origin or kind)


def _type_name(kind: Any) -> str:
    return str(kind) if get_args(kind) else getattr(kind, "__name__", str(kind))


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# What a chat longer than a model's context gets (engines/generation/context.py).
CONTEXT_OVERFLOW = ("refuse", "drop_oldest")


@dataclass
class Limits:
    """Admission limits, pushed again by `configure` when the admin changes."""

    max_parallel_requests: int = 32
    # The most slots a model with `auto` slots gets (engines/backends/memory.py).
    max_slots_per_model: int = 32
    # Memory for a generation model's KV pool, which its slots share.
    kv_cache_mib: int = 1024
    queue_limit: int = 64
    queue_timeout_s: float = 60.0
    models_max: int = 3
    memory_margin_mib: int = 512
    threads: int = 0  # compute threads per model; 0: one per core
    # The decode loop with work to do and no pass for this long is stuck: the
    # engine reports itself unhealthy and the supervisor replaces it.
    stuck_after_s: float = 60.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Limits":
        return from_known_fields(cls, data)


@dataclass
class ModelSpec:
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
    sampling: dict[str, Any] = field(default_factory=dict)
    chat_template: str = ""
    # Keep each slot's KV between requests, reused for a prompt that starts
    # the same way (engines/generation/slots.py).
    prompt_cache: bool = True
    # A chat longer than the context: "refuse" or "drop_oldest" turns
    # (engines/generation/context.py).
    context_overflow: str = "refuse"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        spec = from_known_fields(cls, data)
        if spec.context_overflow not in CONTEXT_OVERFLOW:
            raise ValueError(
                f"ModelSpec: context_overflow must be one of {CONTEXT_OVERFLOW}, "
                f"not {spec.context_overflow!r}"
            )
        return spec


@dataclass
class VendorThresholds:
    """One GPU vendor's pause/resume temperatures (°C), instead of the defaults."""

    high: float
    resume: float

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VendorThresholds":
        return from_known_fields(cls, data)


@dataclass
class Thresholds:
    """Pause/resume temperatures (°C): the CPU's, the GPUs' defaults, and
    per-vendor GPU overrides. engines/runtime/thermal.py judges each reading by
    `for_device`: work pauses at `high` and resumes only below `resume`."""

    cpu_high: float = 90
    cpu_resume: float = 80
    gpu_high: float = 85
    gpu_resume: float = 75
    overrides: dict[str, VendorThresholds] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Thresholds":
        """Read the JSON form (each override an object), checked as
        from_known_fields."""
        if not isinstance(data, dict):
            raise ValueError(f"Thresholds: expected an object, not {_kind(data)}")
        typed = dict(data)
        if "overrides" in data:
            if not isinstance(data["overrides"], dict):
                raise ValueError("Thresholds: overrides must be an object")
            typed["overrides"] = {
                vendor: VendorThresholds.from_dict(item)
                for vendor, item in data["overrides"].items()
            }
        return from_known_fields(cls, typed)

    def for_device(self, kind: str, vendor: str) -> tuple[float, float]:
        """(high, resume) for a device: "cpu", or a "gpu" of `vendor`."""
        if kind == "cpu":
            return self.cpu_high, self.cpu_resume
        override = self.overrides.get(vendor)
        if override is not None:
            return override.high, override.resume
        return self.gpu_high, self.gpu_resume


def _model_specs(items: Any, *, owner: str) -> dict[str, ModelSpec]:
    """The JSON form's list of models, by name (two with one name refused)."""
    if not isinstance(items, list):
        raise ValueError(f"{owner}: models must be a list")
    specs = [ModelSpec.from_dict(item) for item in items]
    by_name = {spec.name: spec for spec in specs}
    if len(by_name) < len(specs):
        raise ValueError(f"{owner}: two models share a name")
    return by_name


@dataclass
class EngineConfig:
    """Everything an engine process needs to start."""

    name: str
    port: int
    backend: str = "cpu"
    limits: Limits = field(default_factory=Limits)
    models: dict[str, ModelSpec] = field(default_factory=dict)
    preload: list[str] = field(default_factory=list)
    # Thermal thresholds, and the GPUs this engine owns (UUIDs or indices):
    # only those pause it (engines/runtime/thermal.py).
    thermal: Thresholds = field(default_factory=Thresholds)
    devices: list[str] = field(default_factory=list)
    # CPU cores the process may run on (set when it starts); empty: all.
    cpus: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        """Read the JSON form (models as a list), checked as from_known_fields."""
        if not isinstance(data, dict):
            raise ValueError(f"EngineConfig: expected an object, not {_kind(data)}")
        typed = dict(data)
        if "limits" in data:
            typed["limits"] = Limits.from_dict(data["limits"])
        if "models" in data:
            typed["models"] = _model_specs(data["models"], owner=cls.__name__)
        if "thermal" in data:
            typed["thermal"] = Thresholds.from_dict(data["thermal"])
        return from_known_fields(cls, typed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "port": self.port,
            "backend": self.backend,
            "limits": asdict(self.limits),
            "models": [asdict(model) for model in self.models.values()],
            "preload": list(self.preload),
            "thermal": asdict(self.thermal),
            "devices": list(self.devices),
            "cpus": list(self.cpus),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_env(cls) -> "EngineConfig":
        """The configuration the supervisor handed over: the JSON in CONFIG_ENV,
        or in the file CONFIG_FILE_ENV names (deleted once read)."""
        path = os.environ.get(CONFIG_FILE_ENV)
        if path:
            try:
                with open(path, encoding="utf-8") as handle:
                    raw = handle.read()
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        else:
            raw = os.environ.get(CONFIG_ENV, "")
        if not raw:
            raise SystemExit(
                f"{CONFIG_ENV} is not set: engines are started by `manage.py supervise`"
            )
        return cls.from_dict(json.loads(raw))


@dataclass
class LiveConfig:
    """What `configure` changes in a running engine: the supervisor pushes it
    when the admin changes these (the rest of EngineConfig needs a restart).
    The request's `config` field is its `to_dict`, read back with `from_dict`
    (unknown keys refused, as EngineConfig). A setting left out (None) stays as
    it runs; a limits block given in part takes the defaults for the rest."""

    limits: Limits | None = None
    models: dict[str, ModelSpec] | None = None
    thermal: Thresholds | None = None
    devices: list[str] | None = None

    @classmethod
    def of(cls, config: EngineConfig) -> "LiveConfig":
        """Every live setting of a whole configuration."""
        return cls(
            limits=config.limits,
            models=dict(config.models),
            thermal=config.thermal,
            devices=list(config.devices),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LiveConfig":
        """Read the JSON form (models as a list), checked as from_known_fields."""
        if not isinstance(data, dict):
            raise ValueError(f"LiveConfig: expected an object, not {_kind(data)}")
        readers = {
            "limits": Limits.from_dict,
            "models": lambda items: _model_specs(items, owner=cls.__name__),
            "thermal": Thresholds.from_dict,
        }
        typed = {
            key: readers[key](value) if key in readers and value is not None else value
            for key, value in data.items()
        }
        return from_known_fields(cls, typed)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the settings given, none for those left out."""
        data: dict[str, Any] = {}
        if self.limits is not None:
            data["limits"] = asdict(self.limits)
        if self.models is not None:
            data["models"] = [asdict(model) for model in self.models.values()]
        if self.thermal is not None:
            data["thermal"] = asdict(self.thermal)
        if self.devices is not None:
            data["devices"] = list(self.devices)
        return data

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
