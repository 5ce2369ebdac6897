"""How many of a GGUF model's layers go on an engine's GPUs, and how they are
split over its cards: a pure plan from the model's sizes and the cards' free
memory, made before each load (engines/backends/factory.py) and shown in the
engine's `state`.

What llama.cpp does with the plan (llama_model::load_tensors), and so what
this plans for: `n_gpu_layers` counts the model's repeating layers (`blk.N`)
plus one for the output layer (output norm and output projection, or the
token embedding again when the model ties them). The last `n_gpu_layers` of
the repeating layers go to the cards; the output layer goes only when every
repeating layer does (n_gpu_layers = layers + 1: "all"). The input layer (the
token embedding) always stays on the CPU. A layer's KV cache lives where the
layer does. The offloaded layers are split over the cards in order by the
cumulative proportions of `tensor_split` (split mode "layer"). Each card that
holds layers reserves a compute buffer; the CPU does too while any layer runs
there.

`auto` (the default): as many layers as fit, the output layer last, with each
card's free memory less the engine's margin as its room, split in proportion
to that room (or to the model's `tensor_split` shares). The rest runs on the
CPU: the model still loads, only slower.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GIB = 1024.0


@dataclass(frozen=True)
class LayerSizes:
    """A GGUF model's memory by where llama.cpp places it, in MiB: each
    repeating layer's weights, the input layer's (CPU) and the output layer's,
    the KV cache per repeating layer at the serving context, and the compute
    buffer each device that computes reserves: `compute_mib` where the output
    layer runs (its logits may be the largest step), `layer_compute_mib`
    (the attention's alone; default: the same) elsewhere."""

    blocks: tuple[float, ...]
    input_mib: float
    output_mib: float
    kv_per_layer_mib: float
    compute_mib: float
    layer_compute_mib: float | None = None

    @property
    def layers(self) -> int:
        """llama.cpp's layer count: the repeating layers and the output."""
        return len(self.blocks) + 1

    @property
    def total_mib(self) -> float:
        """Everything, as if served on one device."""
        return (
            sum(self.blocks)
            + len(self.blocks) * self.kv_per_layer_mib
            + self.input_mib
            + self.output_mib
            + self.compute_mib
        )


@dataclass(frozen=True)
class Card:
    """One card the engine owns: its label, its free memory (MiB) and its
    number among the cards llama.cpp sees (None: its place in the list)."""

    name: str
    free_mib: float
    device: int | None = None


@dataclass(frozen=True)
class OffloadPlan:
    """What a load asks llama.cpp for (`n_gpu_layers` of `layers`, split by
    the `tensor_split` proportions, one per card, over llama.cpp's devices
    `devices`, `main_gpu` the index of the card with the most free memory),
    the MiB it places on each card and on the CPU, and why, in one line.
    `fits` is False when the model fits nowhere (the cards take what they
    can and the host cannot hold the rest)."""

    n_gpu_layers: int
    layers: int
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    cards: tuple[tuple[str, float], ...] = ()
    cpu_mib: float = 0.0
    reason: str = ""
    fits: bool = True
    devices: tuple[int, ...] = ()

    def llama_split(self, max_devices: int) -> tuple[list[float], int]:
        """llama.cpp's `tensor_split` (a share per device it sees, up to
        `max_devices`; the engine's cards' shares at their devices, 0
        elsewhere) and its `main_gpu` device."""
        split = [0.0] * max_devices
        for device, share in zip(self.devices, self.tensor_split, strict=True):
            if device < max_devices:
                split[device] = share
        main = self.devices[self.main_gpu] if self.devices else 0
        return split, main

    def describe(self) -> dict[str, Any]:
        """The plan as `state` reports it (engines/wire/replies.py Offload)."""
        return {
            "gpu_layers": self.n_gpu_layers,
            "layers": self.layers,
            "cards_mib": {name: round(mib, 1) for name, mib in self.cards},
            "cpu_mib": round(self.cpu_mib, 1),
            "reason": self.reason,
        }


def _gib(mib: float) -> str:
    return f"{mib / GIB:.1f} GiB" if mib >= GIB else f"{mib:.0f} MiB"


def split_shares(setting: str, rooms: Sequence[float]) -> list[float]:
    """Each card's share of the offloaded layers: the setting's shares ("3,1",
    one per card in order; missing ones 0, extra ones ignored), else each
    card's room. All zero (no room anywhere): equal shares."""
    if setting:
        shares = [float(part) for part in setting.split(",")][: len(rooms)]
        shares += [0.0] * (len(rooms) - len(shares))
    else:
        shares = [max(room, 0.0) for room in rooms]
    if not sum(shares) > 0:
        shares = [1.0] * len(rooms)
    total = sum(shares)
    return [share / total for share in shares]


def _devices_of(offloaded: int, shares: Sequence[float]) -> list[int]:
    """Which card each of the `offloaded` llama.cpp layers goes to
    (llama.cpp's rule: the card whose cumulative share first exceeds the
    layer's position among the offloaded ones)."""
    bounds = list(_cumulative(shares))
    placed = []
    for position in range(offloaded):
        at = position / offloaded
        card = next((i for i, bound in enumerate(bounds) if at < bound), None)
        placed.append(len(shares) - 1 if card is None else card)
    return placed


def _cumulative(shares: Sequence[float]):
    total = 0.0
    for share in shares:
        total += share
        yield total


def _layer_compute(sizes: LayerSizes) -> float:
    if sizes.layer_compute_mib is None:
        return sizes.compute_mib
    return sizes.layer_compute_mib


def _placement(
    sizes: LayerSizes, offloaded: int, shares: Sequence[float]
) -> tuple[list[float], float]:
    """The MiB on each card and on the CPU with `offloaded` llama.cpp layers
    on the cards: the last repeating layers, and the output layer only when
    every repeating layer is offloaded."""
    blocks = len(sizes.blocks)
    per_layer = [mib + sizes.kv_per_layer_mib for mib in sizes.blocks]
    on_cards = list(range(max(blocks - offloaded, 0), blocks))
    output_on_cards = offloaded > blocks
    if output_on_cards:
        on_cards.append(blocks)  # the output layer, last
    cards = [0.0] * len(shares)
    computes = [0.0] * len(shares)
    for layer, card in zip(on_cards, _devices_of(offloaded, shares), strict=True):
        output = layer == blocks
        cards[card] += sizes.output_mib if output else per_layer[layer]
        compute = sizes.compute_mib if output else _layer_compute(sizes)
        computes[card] = max(computes[card], compute)
    cards = [mib + compute for mib, compute in zip(cards, computes, strict=True)]
    cpu = sizes.input_mib + sum(per_layer[: max(blocks - offloaded, 0)])
    if not output_on_cards:  # the output layer (its logits) runs on the CPU
        cpu += sizes.output_mib + sizes.compute_mib
    return cards, cpu


def _layers_setting(setting: str, layers: int) -> int | None:
    """The setting's layer count (None: auto), capped at the model's."""
    if setting == "all":
        return layers
    if setting == "none":
        return 0
    if setting.isdigit():
        return min(int(setting), layers)
    return None


def plan_offload(
    sizes: LayerSizes,
    cards: Sequence[Card],
    *,
    margin_mib: float,
    gpu_layers: str = "auto",
    tensor_split: str = "",
    host_free_mib: float | None = None,
) -> OffloadPlan:
    """The plan for one load. `cards`: the engine's cards (none: a CPU
    engine, every layer on the CPU). Each card's room is its free memory
    less `margin_mib`. `gpu_layers` auto: the most layers whose placement
    fits every card's room; all, none or a number: that many (a number
    capped at the model's layers), fitting or not. `host_free_mib` (when
    known): the plan fits nowhere when the CPU's part exceeds it less the
    margin."""
    layers = sizes.layers
    if not cards:
        return OffloadPlan(
            0,
            layers,
            cpu_mib=_placement(sizes, 0, [1.0])[1],
            reason=f"no GPU: all {layers} layers on the CPU",
        )
    rooms = [card.free_mib - margin_mib for card in cards]
    # By free memory: a card that cannot take one layer with its compute
    # buffer gets no share (it would only fail the plan).
    one = min(sizes.blocks, default=0.0) + sizes.kv_per_layer_mib
    one += _layer_compute(sizes)
    usable = [room if room >= one else 0.0 for room in rooms]
    shares = split_shares(tensor_split, usable)
    chosen = _layers_setting(gpu_layers, layers)
    if chosen is None:
        chosen = next(
            (
                count
                for count in range(layers, 0, -1)
                if all(
                    mib <= room
                    for mib, room in zip(
                        _placement(sizes, count, shares)[0], rooms, strict=True
                    )
                )
            ),
            0,
        )
    placed, cpu = _placement(sizes, chosen, shares)
    main = max(range(len(cards)), key=lambda i: cards[i].free_mib)
    reason = _reason(sizes, cards, rooms, chosen, placed, gpu_layers, margin_mib)
    fits = True
    if host_free_mib is not None and cpu > host_free_mib - margin_mib:
        fits = False
        reason = (
            f"fits nowhere: needs {_gib(sizes.total_mib)}; the cards take "
            f"{_gib(sum(placed))} ({chosen} of {layers} layers) and the rest, "
            f"{_gib(cpu)}, is more than the host's "
            f"{_gib(max(host_free_mib - margin_mib, 0))} free less the "
            f"{margin_mib:.0f} MiB margin"
        )
    return OffloadPlan(
        chosen,
        layers,
        tuple(shares),
        main,
        tuple((cards[i].name, mib) for i, mib in enumerate(placed)),
        cpu,
        reason,
        fits,
        tuple(
            i if card.device is None else card.device for i, card in enumerate(cards)
        ),
    )


def _reason(
    sizes: LayerSizes,
    cards: Sequence[Card],
    rooms: Sequence[float],
    chosen: int,
    placed: Sequence[float],
    setting: str,
    margin_mib: float,
) -> str:
    """One line: where the layers went, or why none could."""
    layers = sizes.layers
    how = "" if setting == "auto" else f" (set: {setting})"
    if chosen == 0 and setting == "auto":
        smallest = min(
            (mib + sizes.kv_per_layer_mib for mib in sizes.blocks),
            default=sizes.output_mib,
        )
        need = smallest + _layer_compute(sizes)
        best = max(range(len(cards)), key=lambda i: rooms[i])
        return (
            f"no layer fits: a layer needs {_gib(need)} with its compute "
            f"buffer, the largest free is {_gib(cards[best].free_mib)} on "
            f"{cards[best].name}, less the {margin_mib:.0f} MiB margin"
        )
    if chosen == 0:
        return f"all {layers} layers on the CPU{how}"
    used = [(card.name, mib) for card, mib in zip(cards, placed, strict=True) if mib]
    where = ", ".join(f"{name} {_gib(mib)}" for name, mib in used)
    count = f"{len(used)} card{'s' if len(used) > 1 else ''}"
    text = f"{chosen} of {layers} layers on {count} ({where})"
    rest = layers - chosen
    text += f", {rest} on the CPU" if rest else ""
    over = [
        card.name
        for card, mib, room in zip(cards, placed, rooms, strict=True)
        if mib > room and not math.isclose(mib, room)
    ]
    if over and setting != "auto":
        text += f"; more than the free memory of {', '.join(over)}"
    return text + how
