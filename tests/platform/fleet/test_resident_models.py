"""What the supervisor records of an engine's resident models (the state it
reads back from the engine, as EngineState.resident_models)."""

from engines.wire.replies import ModelState, OffloadState, StateReply
from fleet.admin import _residence_text
from fleet.recorder import resident_models_of
from fleet.selectors import Residence


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


def test_what_was_measured_is_recorded_and_shown_beside_the_plan():
    """The model's measured tokens/s and what its load took on each card are
    recorded with the plan and shown on the model's admin page after it; a
    model with nothing measured yet (no token, no card grew) shows neither."""
    (recorded,) = resident_models_of(
        state_with(tokens_per_s=41.25, device_cards_mib={"gpu-0": 6041.6})
    )
    assert recorded["tokens_per_s"] == 41.25
    assert recorded["device_cards_mib"] == {"gpu-0": 6041.6}
    (nothing,) = resident_models_of(state_with())
    assert "tokens_per_s" not in nothing and "device_cards_mib" not in nothing

    where = Residence(
        engine="gpu0",
        memory_mib=312,
        offload="18 of 31 layers on 1 card (gpu-0 6.1 GiB), 13 on the CPU",
        tokens_per_s=41.25,
        device_cards_mib={"gpu-0": 6041.6},
    )
    assert _residence_text(where) == (
        "gpu0 (312 MiB); 18 of 31 layers on 1 card (gpu-0 6.1 GiB), 13 on the "
        "CPU; measured: 5.9 GiB on gpu-0, 41.2 tokens/s"
    )
    assert "measured" not in _residence_text(Residence(engine="cpu0", memory_mib=3))
