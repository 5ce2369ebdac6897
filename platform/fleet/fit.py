"""Whether a model fits, before a byte of its weights is downloaded: its
memory need against the free memory of every engine that could serve it.

An engine is a place: a CPU engine's room is its host's free RAM, a GPU
engine's the free memory of the cards it owns (its spec's devices, by UUID or
index; every card of its host when it names none), summed, as llama.cpp
splits layers over them. A host's free memory is what its heartbeat wrote in
its node's `hardware` (`ram_free_mib`, each card's `free_mib`), else its
totals less what its engines report holding (their RSS for RAM, their
resident models for a card); on one host without nodes it is read now
(psutil, and the device probes the engines use). The arithmetic (`places`,
`fit_lines`) works on plain data; `fit_places` gathers it from the database."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil
from django.conf import settings

from engines.launch.devices import default_memory_probes
from routing.compat import capabilities_for

from .models import Backend, EngineSpec

MIB_PER_GIB = 1024


@dataclass(frozen=True)
class EngineFacts:
    """What the fit needs of one engine: where it runs, on which memory, and
    what it holds now (for hosts that report totals only)."""

    name: str
    node: str  # "" on one host without nodes
    gpu: bool
    devices: tuple[str, ...] = ()
    rss_mib: float = 0.0  # its process's RAM
    resident_mib: float = 0.0  # its loaded models' memory


@dataclass(frozen=True)
class Place:
    """An engine and its free memory (None: not known, and `unknown` says
    why)."""

    engine: str
    node: str
    gpu: bool
    free_mib: float | None
    unknown: str = ""

    @property
    def label(self) -> str:
        """`cpu0 (node a)`, or `cpu0` on one host."""
        return f"{self.engine} (node {self.node})" if self.node else self.engine


def places(
    engines: Iterable[EngineFacts], hardware: Mapping[str, Mapping]
) -> list[Place]:
    """Each engine with the free memory of its host's RAM or its cards, from
    `hardware` (node name -> a heartbeat's `hardware`; "" for this host)."""
    engines = list(engines)
    found = []
    for engine in engines:
        host = hardware.get(engine.node) or {}
        free = (_card_free if engine.gpu else _ram_free)(engine, host, engines)
        found.append(
            Place(
                engine=engine.name,
                node=engine.node,
                gpu=engine.gpu,
                free_mib=free,
                unknown="" if free is not None else _why_unknown(engine, host),
            )
        )
    return found


def _why_unknown(engine: EngineFacts, hardware: Mapping) -> str:
    """Why an engine's free memory is not known: its node never reported, or
    its host has none of its cards."""
    if not hardware:
        return "its node has not reported its memory yet (no heartbeat)"
    if engine.devices:
        return f"its host has none of its cards ({', '.join(engine.devices)})"
    return "its host reports no GPU"


def _ram_free(engine: EngineFacts, hardware: Mapping, engines: list) -> float | None:
    """The host's free RAM: reported, else its total less its engines' RSS."""
    if hardware.get("ram_free_mib") is not None:
        return float(hardware["ram_free_mib"])
    if not hardware.get("ram_mib"):
        return None
    held = sum(other.rss_mib for other in engines if other.node == engine.node)
    return max(float(hardware["ram_mib"]) - held, 0.0)


def _card_free(engine: EngineFacts, hardware: Mapping, engines: list) -> float | None:
    """The free memory of the engine's cards: reported, else their total
    less the models held by the GPU engines that share any of them."""
    cards = _cards_of(engine, hardware)
    if not cards:
        return None
    if all(card.get("free_mib") is not None for card in cards):
        return sum(float(card["free_mib"]) for card in cards)
    names = {name for card in cards for name in card.get("names", ())}
    held = sum(
        other.resident_mib
        for other in engines
        if other.gpu
        and other.node == engine.node
        and names & {n for c in _cards_of(other, hardware) for n in c.get("names", ())}
    )
    total = sum(float(card.get("memory_mib") or 0) for card in cards)
    return max(total - held, 0.0)


def _cards_of(engine: EngineFacts, hardware: Mapping) -> list[Mapping]:
    """The host's cards the engine owns (all of them when it names none)."""
    cards = list(hardware.get("gpus") or ())
    if not engine.devices:
        return cards
    owned = set(engine.devices)
    return [card for card in cards if owned & {str(n) for n in card.get("names", ())}]


def fit_lines(need_mib: float, where: Iterable[Place]) -> list[str]:
    """What the fit says, one line per place it fits on, roomiest first
    ("fits on cpu0 (node a), 1.2 GiB to spare"), else one line saying it fits
    nowhere and the largest free memory; places whose host reported nothing
    get a line of their own."""
    where = list(where)
    if not where:
        return ["no engine serves it: add one (Fleet -> Engine specs)"]
    known = sorted(
        (place for place in where if place.free_mib is not None),
        key=lambda place: -place.free_mib,
    )
    unknown = [
        f"{place.label}: free memory not known, {place.unknown or 'unreported'}"
        for place in where
        if place.free_mib is None
    ]
    fits = [
        f"fits on {place.label}, {size_text(place.free_mib - need_mib)} to spare"
        for place in known
        if place.free_mib >= need_mib
    ]
    if fits or not known:
        return fits + unknown
    largest = known[0]
    return [
        f"fits nowhere: needs {size_text(need_mib)}, the largest free is "
        f"{size_text(largest.free_mib)} on {largest.label}",
        *unknown,
    ]


def size_text(mib: float) -> str:
    """`1.2 GiB`, or `312 MiB` under a GiB."""
    if mib >= MIB_PER_GIB:
        return f"{mib / MIB_PER_GIB:.1f} GiB"
    return f"{mib:.0f} MiB"


def this_host_hardware() -> dict:
    """This host's memory now, shaped as a heartbeat's `hardware`: RAM free
    (psutil's available) and each card's free memory (the engines' probes,
    ROUNDHOUSE_DEVICE_MEMORY_FILE's in tests)."""
    memory = psutil.virtual_memory()
    cards = [
        card
        for probe in default_memory_probes(settings.ROUNDHOUSE_DEVICE_MEMORY_FILE)
        for card in probe.read()
    ]
    return {
        "ram_mib": memory.total / 2**20,
        "ram_free_mib": memory.available / 2**20,
        "gpus": [
            {
                "names": sorted(card.names),
                "memory_mib": card.total_mib,
                "free_mib": card.free_mib,
            }
            for card in cards
        ],
    }


def fit_places(*, model_format: str) -> list[Place]:
    """Every enabled engine that serves `model_format` (on a node not
    revoked), with its free memory now."""
    specs = [
        spec
        for spec in EngineSpec.objects.filter(enabled=True)
        .select_related("node", "state")
        .order_by("order", "name")
        if model_format in capabilities_for(spec.backend, spec.capabilities)
        and (spec.node is None or spec.node.revoked_at is None)
    ]
    hardware = {
        spec.node.name: spec.node.hardware for spec in specs if spec.node is not None
    }
    if any(spec.node is None for spec in specs):
        hardware[""] = this_host_hardware()
    return places([_facts(spec) for spec in specs], hardware)


def _facts(spec: EngineSpec) -> EngineFacts:
    state = getattr(spec, "state", None)
    return EngineFacts(
        name=spec.name,
        node=spec.node.name if spec.node else "",
        gpu=spec.backend != Backend.CPU,
        devices=tuple(spec.device_list),
        rss_mib=(state.memory_mib or 0.0) if state else 0.0,
        resident_mib=sum(
            float(item.get("memory_mib") or 0) for item in state.resident_models
        )
        if state
        else 0.0,
    )
