"""What the supervisor records of an engine's resident models (the state it
reads back from the engine, as EngineState.resident_models)."""

from engines.wire.replies import ModelState, OffloadState, StateReply
from fleet.recorder import resident_models_of


def state_with(**model) -> StateReply:
    """A state with one resident model (the rest of the state unread)."""
    return StateReply.model_construct(
        models=[
            ModelState(
                name="chatty",
                format="gguf",
                memory_mib=312.4,
                device_memory_mib=900.0,
                loaded_at=0.0,
                idle_s=0.0,
                inflight=0,
                queued=0,
                busy=0,
                **model,
            )
        ],
    )


def test_a_gguf_models_offload_plan_is_recorded():
    offload = OffloadState(
        gpu_layers=18,
        layers=31,
        cards_mib={"gpu-0": 6246.4},
        cpu_mib=2900.0,
        reason="18 of 31 layers on 1 card (gpu-0 6.1 GiB), 13 on the CPU",
    )
    (recorded,) = resident_models_of(state_with(offload=offload))
    assert recorded["offload"] == offload.model_dump()
    (without,) = resident_models_of(state_with())
    assert "offload" not in without
