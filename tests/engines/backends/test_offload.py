"""Offload planning: how many of a GGUF model's layers go on the engine's cards,
split how, from the model's sizes and the cards' free memory (pure: no card
and no llama.cpp needed)."""

import json
from pathlib import Path

import pytest
from django.conf import settings

from engines.backends.ggufmeta import read_header
from engines.backends.memory import gguf_layer_sizes, plan_slots
from engines.backends.offload import Card, LayerSizes, plan_offload
from engines.launch.config import Limits, ModelSpec

# 30 repeating layers of 100 MiB weights and 10 MiB KV each, a 50 MiB output
# layer, a 40 MiB token embedding, 20 MiB of compute where a layer runs and
# 30 MiB where the output layer does: 3,400 MiB on one device.
SIZES = LayerSizes(
    blocks=(100.0,) * 30,
    input_mib=40.0,
    output_mib=50.0,
    kv_per_layer_mib=10.0,
    compute_mib=30.0,
    layer_compute_mib=20.0,
)
MARGIN = 100.0


def plan(*cards: tuple[str, float], **settings_):
    return plan_offload(
        SIZES,
        [Card(name, free) for name, free in cards],
        margin_mib=MARGIN,
        **settings_,
    )


def test_one_card_that_holds_all():
    """Every repeating layer and the output layer (llama.cpp counts 31) on
    the card; only the token embedding stays on the CPU."""
    result = plan(("gpu-0", 8000))
    assert (result.n_gpu_layers, result.layers) == (31, 31)
    assert result.cards == (("gpu-0", 30 * 110 + 50 + 30),)
    assert result.cpu_mib == 40
    assert result.reason == "31 of 31 layers on 1 card (gpu-0 3.3 GiB)"


def test_one_card_that_holds_some_layers():
    """1,000 MiB less the margin: 8 layers of 110 MiB and a 20 MiB compute
    buffer (900 MiB); the other 22 and the output layer on the CPU."""
    result = plan(("gpu-0", 1000))
    assert result.n_gpu_layers == 8
    assert result.cards == (("gpu-0", 8 * 110 + 20),)
    assert result.cpu_mib == 40 + 22 * 110 + 50 + 30
    assert result.reason == "8 of 31 layers on 1 card (gpu-0 900 MiB), 23 on the CPU"


def test_two_unequal_cards_split_by_free_memory():
    """Rooms of 2,000 and 1,000 MiB: the layers split 2:1 (llama.cpp's
    rounding: 18 and 8 of 26; a 27th would put 9 layers, 1,010 MiB, on
    gpu-1), main card the larger."""
    result = plan(("gpu-0", 2100), ("gpu-1", 1100))
    assert result.tensor_split == pytest.approx((2 / 3, 1 / 3))
    assert result.main_gpu == 0
    assert result.n_gpu_layers == 26
    assert dict(result.cards) == {"gpu-0": 18 * 110 + 20, "gpu-1": 8 * 110 + 20}
    assert result.reason == (
        "26 of 31 layers on 2 cards (gpu-0 2.0 GiB, gpu-1 900 MiB), 5 on the CPU"
    )
    # The larger card second: it is the main one.
    assert plan(("gpu-0", 1100), ("gpu-1", 2100)).main_gpu == 1


def test_a_card_too_small_for_one_layer():
    result = plan(("gpu-0", 200))
    assert result.n_gpu_layers == 0
    assert result.cards == (("gpu-0", 0.0),)
    assert result.cpu_mib == SIZES.total_mib
    assert result.reason == (
        "no layer fits: a layer needs 130 MiB with its compute buffer, the "
        "largest free is 200 MiB on gpu-0, less the 100 MiB margin"
    )


def test_a_card_too_small_for_a_layer_gets_no_share():
    """Next to a large card, a card that cannot take one layer takes none."""
    result = plan(("gpu-0", 2100), ("gpu-1", 200))
    assert result.tensor_split == (1.0, 0.0)
    assert dict(result.cards)["gpu-1"] == 0
    assert "on 1 card (gpu-0" in result.reason


def test_a_model_larger_than_every_card_together_loads_partly():
    result = plan(("gpu-0", 700), ("gpu-1", 700))
    assert 0 < result.n_gpu_layers < 31
    assert all(mib <= 600 for _, mib in result.cards)
    assert result.fits
    assert result.reason.endswith(f"{31 - result.n_gpu_layers} on the CPU")


def test_fits_nowhere_when_the_host_cannot_hold_the_rest():
    result = plan(("gpu-0", 1000), host_free_mib=1500)
    assert not result.fits
    assert result.reason.startswith("fits nowhere: needs 3.3 GiB; the cards take")
    assert "less the 100 MiB margin" in result.reason
    assert plan(("gpu-0", 1000), host_free_mib=8000).fits  # the control


def test_an_explicit_number_of_layers_is_capped_at_the_model():
    assert plan(("gpu-0", 8000), gpu_layers="5").n_gpu_layers == 5
    capped = plan(("gpu-0", 8000), gpu_layers="999")
    assert capped.n_gpu_layers == 31
    assert capped.reason.endswith("(set: 999)")


def test_all_and_none():
    """`all` is taken as asked, even past the card's room (and says so);
    `none` keeps every layer on the CPU."""
    forced = plan(("gpu-0", 1000), gpu_layers="all")
    assert forced.n_gpu_layers == 31
    assert "more than the free memory of gpu-0" in forced.reason
    none = plan(("gpu-0", 8000), gpu_layers="none")
    assert none.n_gpu_layers == 0
    assert none.reason == "all 31 layers on the CPU (set: none)"
    assert none.cpu_mib == SIZES.total_mib


def test_an_explicit_split():
    """Shares 1,3 over two equal cards: a quarter of the layers on the first."""
    result = plan(("gpu-0", 8000), ("gpu-1", 8000), tensor_split="1,3")
    assert result.tensor_split == (0.25, 0.75)
    assert result.n_gpu_layers == 31
    placed = dict(result.cards)
    assert placed["gpu-0"] == 8 * 110 + 20  # layers 0-7 of 31
    assert placed["gpu-1"] == 22 * 110 + 50 + 30  # the rest and the output


def test_a_cpu_engine_plans_nothing_on_cards():
    result = plan()
    assert (result.n_gpu_layers, result.cards, result.tensor_split) == (0, (), ())
    assert result.cpu_mib == SIZES.total_mib
    assert result.reason == "no GPU: all 31 layers on the CPU"
    assert result.fits


def test_a_real_headers_layers_add_up_to_the_estimate():
    """SmolLM2's header: 30 layers of equal size; the sizes on one device
    add up to the residency estimate plus the tied output layer (the token
    embedding again, as llama.cpp places it) and the per-group compute."""
    spec = ModelSpec(
        name="m",
        format="gguf",
        path=str(Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        context_length=512,
        slots=1,
    )
    slots = plan_slots(spec, Limits())
    header = read_header(spec.path)
    sizes = gguf_layer_sizes(header, slots)
    assert sizes.layers == 31 and len(set(sizes.blocks)) == 1
    weights = sum(sizes.blocks) + sizes.input_mib + sizes.output_mib
    file_mib = Path(spec.path).stat().st_size / 2**20
    # Header bytes aside, the tied output duplicates the embedding.
    assert weights - sizes.input_mib == pytest.approx(file_mib, rel=0.03)
    assert sizes.kv_per_layer_mib * 30 == pytest.approx(slots.kv_mib)


def test_llama_split_places_the_shares_at_the_cards_devices():
    """An engine owning llama.cpp's devices 1 and 3 of four: their shares
    there, 0 on the cards it does not own, the main card by device."""
    cards = [Card("gpu-1", 1100, device=1), Card("gpu-3", 2100, device=3)]
    result = plan_offload(SIZES, cards, margin_mib=MARGIN)
    assert result.devices == (1, 3)
    split, main = result.llama_split(4)
    assert split == pytest.approx([0, 1 / 3, 0, 2 / 3])
    assert main == 3


def test_cards_are_numbered_as_cuda_shows_them(tmp_path):
    """Each owned card's llama.cpp device is its place among every card (PCI
    order) when CUDA shows them all; with CUDA_VISIBLE_DEVICES it is the
    card's place in that list (names or indices), and an owned card the list
    leaves out is not planned on at all."""
    from engines.backends.factory import offload_cards
    from engines.launch.devices import DeviceMemory, FileMemoryProbe

    path = tmp_path / "cards.json"
    gpus = [{"id": f"GPU-{n}", "total_mib": 8000, "used_mib": 0} for n in "ABCD"]
    path.write_text(json.dumps({"gpus": gpus}))
    memory = DeviceMemory([FileMemoryProbe(path)], ["GPU-B", "GPU-D"])

    def devices(visible):
        return {card.name: card.device for card in offload_cards(memory, visible)}

    assert devices(None) == {"GPU-B": 1, "GPU-D": 3}
    assert devices(["GPU-D", "GPU-B"]) == {"GPU-D": 0, "GPU-B": 1}
    assert devices(["GPU-B", "GPU-C"]) == {"GPU-B": 0}
