"""Every environment variable an engine reads, each with one comment, and
the functions that read them (an engine reads its environment only here),
with what an engine's environment may hold: what it inherits from the process
that starts it, and what exec accepts. The schemas of what it is told are
engines/launch/config.py."""

import contextlib
import os
from collections.abc import Mapping

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
# CUDA_VISIBLE_DEVICES: the cards CUDA shows the engine (indices or UUIDs; set in
# the engine spec's env block). llama.cpp numbers the visible cards from 0 in
# this order; an engine's offload plan gives each card its share by that number.
CUDA_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
# CUDA_DEVICE_ORDER: how CUDA numbers the cards. Engines start with PCI_BUS_ID
# (nvidia-smi's and NVML's order, which the memory probes read) unless the
# spec's env block says otherwise; CUDA's own default is fastest first.
CUDA_ORDER_ENV = "CUDA_DEVICE_ORDER"
ENGINE_DEFAULT_ENV = {CUDA_ORDER_ENV: "PCI_BUS_ID"}
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


def config_from_environment() -> str:
    """The configuration JSON the supervisor handed over: CONFIG_ENV's, or the
    content of the file CONFIG_FILE_ENV names (deleted once read); "" when
    neither is set."""
    path = os.environ.get(CONFIG_FILE_ENV)
    if not path:
        return os.environ.get(CONFIG_ENV, "")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def config_in_environment() -> bool:
    """Whether a configuration was handed over (CONFIG_ENV or CONFIG_FILE_ENV)."""
    return bool(os.environ.get(CONFIG_ENV) or os.environ.get(CONFIG_FILE_ENV))


def cuda_visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_ENV as a list of the cards' names (indices or UUIDs) in
    CUDA's order; None when unset (every card visible, in PCI order)."""
    value = os.environ.get(CUDA_VISIBLE_ENV)
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def thermal_file() -> str | None:
    """THERMAL_FILE_ENV: the temperature file to read instead of the sensors;
    None when unset or empty (read the sensors)."""
    return os.environ.get(THERMAL_FILE_ENV) or None


def device_memory_file() -> str | None:
    """DEVICE_MEMORY_FILE_ENV: the GPU memory file to read instead of
    nvidia-smi / sysfs; None when unset or empty (read the cards)."""
    return os.environ.get(DEVICE_MEMORY_FILE_ENV) or None


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
