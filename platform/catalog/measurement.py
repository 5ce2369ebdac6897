"""A model's memory, measured by loading it in a child process
(`python -m engines.inspection.probe`) as an engine would: with its configured context
and slots, on a backend's devices. The catalog stores the host and device
figures on the model (services.model_memory_record), where the engines'
residency decisions read them instead of their estimates."""

from engines.inspection.messages import ProbeRequest, ProbeResult

from .models import ModelConfig
from .tool_processes import run_inspection

# A load that takes longer is killed and reported as timed out.
PROBE_TIMEOUT_S = 300.0


def probe_request(model: ModelConfig, *, backend: str = "cpu") -> ProbeRequest:
    """What the probe loads: the model's files, task, context and slots.
    Slots left to `auto` are sized with the engines' default limits (KV
    budget, slot cap): the catalog does not know which engine will serve the
    model, and an engine's own load measures it again with its limits."""
    return ProbeRequest(
        format=model.format,
        path=str(model.resolved_path),
        task=model.task,
        backend=backend,
        context_length=model.context_length,
        slots=model.slots,
    )


def measure_memory(
    model: ModelConfig, *, backend: str = "cpu", timeout_s: float = PROBE_TIMEOUT_S
) -> ProbeResult:
    """Load the model in a child process and report what it took (or the
    problem: a missing file, a failed load, `timed out after N s`)."""
    request = probe_request(model, backend=backend)
    return run_inspection(
        "engines.inspection.probe", request, ProbeResult, timeout_s=timeout_s
    )
