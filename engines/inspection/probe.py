"""`python -m engines.inspection.probe`: load one model as an engine would, with its
context and slot plan, and report the memory the load took (engines.inspection.messages
ProbeRequest on stdin, ProbeResult on stdout).

Host memory is the process's RSS growth across the load, measured the way an
engine measures its own loads (engines/runtime/residency.py), with the ML library
already imported: it is shared by every model an engine holds, so it is not
this model's. Device memory is the growth of the cards' used memory (nvidia-smi
/ sysfs, engines/launch/devices.py) on a GPU backend, or torch's own count where the
cards show none. The catalog runs this in a child process with a timeout and
kills it past that; the process ends after one model."""

import gc
import sys
import time
from pathlib import Path

import psutil

from engines.backends.factory import load_backend, offload_cards, visible_cards
from engines.backends.memory import estimate_model_mib
from engines.inspection.messages import MIB, ProbeRequest, ProbeResult, inspection_main
from engines.launch.config import GPU_BACKENDS, Limits, ModelSpec
from engines.launch.devices import DeviceMemory, default_memory_probes
from engines.launch.environment import device_memory_file
from engines.wire.errors import ProtocolError


def _import_library(fmt: str) -> None:
    """Import the library the model's backend uses, before measuring."""
    if fmt == "gguf":
        from engines.backends import gguf  # noqa: F401 (llama_cpp and ggml, loaded)
    elif fmt == "transformers":
        from engines.backends import hf  # noqa: F401 (torch and transformers)
    else:
        import sentence_transformers  # noqa: F401


def _torch_device_mib() -> float:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0.0
    return torch.cuda.memory_reserved() / MIB


def probe(request: ProbeRequest) -> ProbeResult:
    """Load the model, measure, and say what it took (or what went wrong)."""
    path = Path(request.path)
    if not path.exists():
        return ProbeResult(problem=f"not found: {path}")
    spec = ModelSpec(
        name=path.name,
        format=request.format,
        path=str(path),
        task=request.task,
        context_length=request.context_length,
        slots=request.slots,
    )
    limits = Limits(
        kv_cache_mib=request.kv_cache_mib,
        max_slots_per_model=request.max_slots_per_model,
        threads=request.threads,
    )
    _import_library(request.format)
    cards = None
    if request.backend in GPU_BACKENDS:
        probes = default_memory_probes(device_memory_file())
        cards = DeviceMemory(probes, request.devices)
    process = psutil.Process()
    gc.collect()
    before = process.memory_info().rss
    device_before = cards.used_mib() if cards else None
    started = time.perf_counter()
    try:
        # A GGUF model on cards: offloaded as a load would be, over their
        # free memory now.
        offload = (
            offload_cards(cards, visible_cards(request.backend))
            if cards is not None
            else None
        )
        backend = load_backend(spec, request.backend, limits, cards=offload)
    except ProtocolError as error:
        return ProbeResult(problem=error.message)
    except Exception as error:  # whatever the library raises for a bad model
        return ProbeResult(problem=f"cannot load {path.name}: {error}")
    load_s = time.perf_counter() - started
    host_mib = max(process.memory_info().rss - before, 0) / MIB
    device_mib = None
    if cards is not None:
        grown = max((cards.used_mib() or 0.0) - (device_before or 0.0), 0.0)
        device_mib = grown or _torch_device_mib()
    plan = getattr(backend, "plan", None)
    try:
        estimated = estimate_model_mib(
            spec, pool_tokens=plan.pool_tokens if plan else 0, backend=request.backend
        )
    except (OSError, ValueError, KeyError):
        estimated = None  # files that do not tell; the measurement stands
    return ProbeResult(
        host_mib=round(host_mib, 1),
        device_mib=None if device_mib is None else round(device_mib, 1),
        estimated_mib=None if estimated is None else round(estimated, 1),
        slots=plan.slots if plan else None,
        context=plan.context if plan else None,
        kv_pool_tokens=plan.pool_tokens if plan else None,
        kv_mib=round(plan.kv_mib, 1) if plan else None,
        load_s=round(load_s, 3),
    )


if __name__ == "__main__":
    sys.exit(inspection_main(ProbeRequest, probe))
