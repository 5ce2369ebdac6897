"""What an engine is told at spawn and by `configure`, and the environment
variables it reads (all of them, each commented). No Django here: the supervisor
serialises everything an engine needs into these variables."""

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# ROUNDHOUSE_ENGINE_TOKEN: the per-run secret every request must carry. Only ever
# in the engine's environment (never argv, logs or the database); the engine
# removes it from os.environ once read so its own children do not inherit it.
TOKEN_ENV = "ROUNDHOUSE_ENGINE_TOKEN"  # noqa: S105 - a variable name
# ROUNDHOUSE_ENGINE_CONFIG: JSON of EngineConfig (name, port, backend, limits,
# model catalog). Not secret.
CONFIG_ENV = "ROUNDHOUSE_ENGINE_CONFIG"
# Engines never reach a model hub: weights come from the models directory.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
}

# ROUNDHOUSE_THERMAL_FILE: read temperatures from this JSON file instead of the
# machine's sensors (engines/thermal.py FileProbe). For machines without sensors
# and for tests; unset in production.
THERMAL_FILE_ENV = "ROUNDHOUSE_THERMAL_FILE"
# ROUNDHOUSE_DEVICE_MEMORY_FILE: read GPU memory (total, used) from this JSON file
# instead of nvidia-smi / sysfs (engines/devices.py FileMemoryProbe). For
# machines without a GPU and for tests; unset in production.
DEVICE_MEMORY_FILE_ENV = "ROUNDHOUSE_DEVICE_MEMORY_FILE"
# Backends whose models live in device memory.
GPU_BACKENDS = frozenset({"cuda", "rocm", "vulkan"})

LOOPBACK = "127.0.0.1"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a pinned engine or a
    container's cpuset), which os.cpu_count() ignores."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def from_known_fields(cls, data: dict[str, Any]):
    """Build a dataclass from a dict, ignoring keys it does not know (a newer
    supervisor may send more than this engine understands)."""
    known = {item.name for item in fields(cls)}
    return cls(**{key: value for key, value in data.items() if key in known})


@dataclass
class Limits:
    """Admission limits, pushed again by `configure` when the admin changes."""

    max_parallel_requests: int = 4
    max_slots_per_model: int = 2
    queue_limit: int = 64
    queue_timeout_s: float = 60.0
    models_max: int = 3
    memory_margin_mib: int = 512
    threads: int = 0  # compute threads per model; 0: one per core

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
    slots: int | None = None
    # Memory measured after an earlier load (the supervisor stores it in the
    # catalog); used instead of the estimate when known.
    measured_mib: float | None = None
    measured_device_mib: float | None = None  # the same, on the engine's GPUs
    sampling: dict[str, Any] = field(default_factory=dict)
    chat_template: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        return from_known_fields(cls, data)


@dataclass
class EngineConfig:
    """Everything an engine process needs to start."""

    name: str
    port: int
    backend: str = "cpu"
    limits: Limits = field(default_factory=Limits)
    models: dict[str, ModelSpec] = field(default_factory=dict)
    preload: list[str] = field(default_factory=list)
    # Thermal thresholds (engines/thermal.py Thresholds) and the GPUs this engine
    # owns (UUIDs or indices): only those pause it.
    thermal: dict[str, Any] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    # CPU cores the process may run on (set when it starts); empty: all.
    cpus: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        return cls(
            name=str(data["name"]),
            port=int(data["port"]),
            backend=str(data.get("backend", "cpu")),
            limits=Limits.from_dict(data.get("limits", {})),
            models={
                item["name"]: ModelSpec.from_dict(item)
                for item in data.get("models", [])
            },
            preload=list(data.get("preload", [])),
            thermal=dict(data.get("thermal", {})),
            devices=[str(device) for device in data.get("devices", [])],
            cpus=[int(core) for core in data.get("cpus", [])],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "port": self.port,
            "backend": self.backend,
            "limits": asdict(self.limits),
            "models": [asdict(model) for model in self.models.values()],
            "preload": list(self.preload),
            "thermal": dict(self.thermal),
            "devices": list(self.devices),
            "cpus": list(self.cpus),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_env(cls) -> "EngineConfig":
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            raise SystemExit(
                f"{CONFIG_ENV} is not set: engines are started by `manage.py supervise`"
            )
        return cls.from_dict(json.loads(raw))
