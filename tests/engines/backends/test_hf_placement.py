"""The transformers placement plan (engines/backends/hf_placement.py) as a pure
function: the dtype a model loads in and where its weights go, from its
checkpoint's facts, the engine's backend and cards as plain data, and the
model's dtype and max GPU % settings."""

import json

import pytest

from engines.backends.hf_placement import (
    MIB,
    Card,
    Checkpoint,
    plan_placement,
    planned_dtype,
    read_checkpoint,
)

GIB = 1024  # MiB
# A 7B model stored in bfloat16: 13.0 GiB at two bytes a parameter.
SEVEN_B = Checkpoint("bfloat16", 7_000_000_000, kv_per_token=2 * 32 * 1024)


def card(
    index: int = 0,
    total_gib: float = 80,
    free_gib: float | None = None,
    *,
    bf16: bool = True,
    name: str = "H100",
) -> Card:
    free = total_gib if free_gib is None else free_gib
    return Card(index, name, total_gib * GIB, free * GIB, bf16)


def plan(cards=(), *, backend: str = "cuda", checkpoint=SEVEN_B, **settings):
    return plan_placement(
        backend=backend, cards=list(cards), checkpoint=checkpoint, **settings
    )


def test_a_cpu_engine_loads_float32_on_the_cpu():
    """auto on a CPU engine is float32 (half precision is slow there), on the
    CPU, with no memory caps, whatever cards the machine has."""
    placement = plan([card()], backend="cpu")
    assert (placement.dtype, placement.device_map) == ("float32", "cpu")
    assert placement.max_memory == {} and not placement.on_gpu
    assert placement.load_kwargs() == {"dtype": "float32", "device_map": "cpu"}
    assert placement.reason == "float32 on the CPU"
    assert placement.warnings == ()


def test_a_vulkan_engine_runs_transformers_on_the_cpu_and_says_why():
    placement = plan([card()], backend="vulkan")
    assert placement.device_map == "cpu"
    assert "no Vulkan backend" in placement.reason


def test_explicit_half_precision_on_the_cpu_is_honoured_with_a_warning():
    """The setting wins; float16 and bfloat16 on the CPU each say why they are
    a poor choice there."""
    half = plan(backend="cpu", dtype="float16")
    assert half.dtype == "float16" and half.device_map == "cpu"
    assert "float16 on the CPU is slow" in half.text
    brain = plan(backend="cpu", dtype="bfloat16")
    assert brain.dtype == "bfloat16"
    assert "slower than float32" in brain.warnings[0]
    assert plan(backend="cpu", dtype="float32").warnings == ()


def test_one_big_card_holds_the_model_in_its_own_dtype():
    """A 7B bfloat16 model on an 80 GiB card: bfloat16, all on cuda:0, no
    device map caps (nothing to shard)."""
    placement = plan([card()], kv_tokens=4096)
    assert placement.dtype == "bfloat16"
    assert placement.device_map == "cuda:0"
    assert placement.max_memory == {} and placement.offload_mib == 0
    assert placement.weights_mib == pytest.approx(7e9 * 2 / MIB)
    assert placement.reason.startswith("bfloat16 on card 0 (H100): 13.5 GiB")
    assert "(90%)" in placement.reason


def test_a_float32_checkpoint_stays_float32_on_a_gpu():
    own = Checkpoint("float32", 1_000_000_000)
    assert plan([card()], checkpoint=own).dtype == "float32"
    assert plan([card()], checkpoint=own, dtype="bfloat16").dtype == "bfloat16"


def test_a_small_card_holds_what_fits_and_offloads_the_rest():
    """A 13 GiB model on an 8 GiB card (90%: 7.2 GiB) goes through the auto
    map: the card capped, the rest to the CPU, the offload in the reason."""
    placement = plan([card(total_gib=8, name="RTX 4060")], max_gpu_percent=90)
    assert placement.device_map == "auto"
    weights = 7e9 * 2 / MIB
    assert placement.max_memory[0] == int(8 * GIB * 0.9 * MIB)
    assert placement.max_memory["cpu"] == int(weights * MIB)
    assert placement.offload_mib == pytest.approx(weights - 8 * GIB * 0.9)
    assert placement.reason == (
        "bfloat16 on card 0 (RTX 4060), at most 90% of it; 5.8 GiB offloaded to the CPU"
    )
    assert placement.load_kwargs()["max_memory"] == placement.max_memory


def test_a_card_keeps_room_for_the_kv_of_its_layers():
    """With a KV pool the weights' caps shrink in proportion: weights and KV
    together stay within the card's share."""
    bare = plan([card(total_gib=8)])
    with_kv = plan([card(total_gib=8)], kv_tokens=32_768)
    kv = SEVEN_B.kv_per_token * 32_768 * 2 / MIB
    weights = 7e9 * 2 / MIB
    assert with_kv.max_memory[0] < bare.max_memory[0]
    assert with_kv.max_memory[0] / MIB == pytest.approx(
        8 * GIB * 0.9 * weights / (weights + kv)
    )
    assert with_kv.offload_mib > bare.offload_mib


def test_free_memory_caps_a_card_below_its_percentage():
    """A card whose free memory is below max_gpu_percent of its total gives
    only what is free."""
    placement = plan([card(total_gib=24, free_gib=10)])
    assert placement.device_map == "auto"
    assert placement.max_memory[0] == int(10 * GIB * MIB)


def test_two_cards_shard_the_model_each_capped():
    """Two cards: the auto map over both, each at most max_gpu_percent of its
    total, the CPU entry present (for accelerate's offload), nothing
    offloaded when they hold it."""
    placement = plan([card(0, 24), card(1, 16)], max_gpu_percent=80)
    assert placement.device_map == "auto"
    assert placement.max_memory[0] == int(24 * GIB * 0.8 * MIB)
    assert placement.max_memory[1] == int(16 * GIB * 0.8 * MIB)
    assert "cpu" in placement.max_memory
    assert placement.offload_mib == 0
    assert placement.reason == "bfloat16 over 2 cards, at most 80% of each"


def test_two_small_cards_offload_what_neither_holds():
    placement = plan([card(0, 6), card(1, 4)], max_gpu_percent=100, cpu_free_mib=1)
    assert placement.offload_mib == pytest.approx(7e9 * 2 / MIB - 10 * GIB)
    assert placement.reason.endswith("3.0 GiB offloaded to the CPU")
    assert placement.max_memory["cpu"] == int(1 * MIB)
    assert "the load may fail" in placement.warnings[0]


def test_a_full_card_is_left_out_and_named():
    """A card with under MIN_CARD_MIB free within its cap holds nothing; the
    other one takes the model alone."""
    placement = plan([card(0, 24, free_gib=0.2), card(1, 80)])
    assert placement.device_map == "cuda:1"
    assert "card 0 (H100) too full" in placement.reason


def test_no_usable_card_falls_back_to_the_cpu():
    full = plan([card(0, 24, free_gib=0.1)])
    assert full.device_map == "cpu" and full.dtype == "float32"
    assert "no card has 512 MiB free" in full.reason
    none = plan([])
    assert none.device_map == "cpu" and "torch sees no card" in none.reason


def test_a_card_without_bfloat16_gets_float16():
    """auto on a card without bfloat16 (compute capability under 8.0) loads a
    bfloat16 checkpoint in float16, and says so."""
    placement = plan([card(total_gib=32, bf16=False, name="V100")])
    assert placement.dtype == "float16"
    assert "float16 (a card lacks bfloat16) on card 0 (V100)" in placement.reason
    # one such card among several decides for the whole model
    mixed = plan([card(0, 80), card(1, 32, bf16=False)])
    assert mixed.dtype == "float16"


def test_a_quantized_checkpoint_takes_sixteen_bits_on_a_gpu():
    quantized = Checkpoint(None, 1_000_000_000)
    assert plan([card()], checkpoint=quantized).dtype == "bfloat16"
    assert plan([card(bf16=False)], checkpoint=quantized).dtype == "float16"
    assert plan(backend="cpu", checkpoint=quantized).dtype == "float32"


def test_explicit_settings_win_with_warnings_where_unwise():
    """bfloat16 on a card without it is honoured and warned about; float16 from
    a bfloat16 checkpoint warns of overflow; float32 fits its own size."""
    forced = plan([card(total_gib=32, bf16=False, name="T4")], dtype="bfloat16")
    assert forced.dtype == "bfloat16"
    assert "card 0 (T4) has no bfloat16" in forced.warnings[0]
    half = plan([card()], dtype="float16")
    assert half.dtype == "float16" and "overflow" in half.warnings[0]
    full = plan([card()], dtype="float32")
    assert full.dtype == "float32" and full.warnings == ()
    assert full.weights_mib == pytest.approx(7e9 * 4 / MIB)


@pytest.mark.parametrize("percent", [0, -5, 101])
def test_a_max_gpu_percent_outside_1_to_100_is_refused(percent):
    with pytest.raises(ValueError, match="max_gpu_percent must be 1 to 100"):
        plan([card()], max_gpu_percent=percent)


def test_one_percent_of_a_card_is_too_little_to_use():
    """The smallest valid percentage: 1% of 24 GiB is under MIN_CARD_MIB, so
    the card is not used (the CPU, and why)."""
    placement = plan([card(total_gib=24)], max_gpu_percent=1)
    assert placement.device_map == "cpu"
    assert "within 1% of it" in placement.reason


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        plan([card()], dtype="int8")


def test_the_dtype_an_estimate_takes_is_the_plans():
    """Before the cards are known: the checkpoint's own dtype on a GPU
    engine, float32 on a CPU one, and an explicit setting everywhere."""
    assert planned_dtype(backend="cuda", dtype="auto", checkpoint_dtype="bfloat16") == (
        "bfloat16"
    )
    assert planned_dtype(backend="rocm", dtype="auto", checkpoint_dtype=None) == (
        "bfloat16"
    )
    assert planned_dtype(backend="cpu", dtype="auto", checkpoint_dtype="bfloat16") == (
        "float32"
    )
    assert planned_dtype(backend="vulkan", dtype="float16", checkpoint_dtype=None) == (
        "float16"
    )


def test_the_description_is_in_mib():
    described = plan([card(0, 8)]).describe()
    assert described["device_map"] == "auto"
    assert described["max_memory_mib"]["0"] == pytest.approx(8 * GIB * 0.9, abs=0.1)
    assert set(described) >= {"dtype", "reason", "warnings", "offload_mib"}


def test_the_auto_map_caps_are_what_accelerate_splits_by():
    """At the planning boundary: accelerate's own device map, for a 1B model
    on the meta device (no weights) under the plan's max_memory for two
    800 MiB cards, puts modules on both cards and the CPU and nowhere else.
    (Two real cards cannot be loaded here, and accelerate has no two CPU
    devices to shard over.)"""
    torch = pytest.importorskip("torch")
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    small = [Card(0, "a", 800, 800, True), Card(1, "b", 800, 800, True)]
    placement = plan(small, checkpoint=Checkpoint("bfloat16", parameters))
    assert placement.device_map == "auto" and placement.offload_mib > 0
    device_map = infer_auto_device_map(
        model,
        max_memory=placement.max_memory,
        no_split_module_classes=model._no_split_modules,
        dtype=torch.bfloat16,
    )
    assert set(device_map.values()) == {0, 1, "cpu"}


def test_read_checkpoint_takes_a_folders_dtype_parameters_and_kv(tmp_path):
    """config.json's dtype (or torch_dtype), safetensors headers' shapes, and
    keys plus values per token over the layers."""
    config = {
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "a": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]},
            "b": {"dtype": "BF16", "shape": [3], "data_offsets": [64, 70]},
        }
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(70)
    )
    assert read_checkpoint(tmp_path) == Checkpoint("bfloat16", 35, 2 * 2 * 2 * 8)


def test_read_checkpoint_without_safetensors_counts_bin_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    (tmp_path / "pytorch_model.bin").write_bytes(bytes(200))
    assert read_checkpoint(tmp_path).parameters == 100
    assert read_checkpoint(tmp_path).dtype == "float16"
