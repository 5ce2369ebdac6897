"""Device (GPU) memory: what each card has and uses, read without torch.

NVIDIA cards through NVML (nvidia-ml-py's `pynvml`, imported on first use),
falling back to `nvidia-smi --query-gpu` where the binding is missing or NVML
does not start; AMD cards through sysfs (`mem_info_vram_total` /
`mem_info_vram_used`). Each NVIDIA card answers to its UUID and its index
(NVML's and nvidia-smi's, in PCI bus order), so an engine's spec may name its
cards either way. Machines without a GPU read nothing; tests drive the same
interface from a JSON file whose path the engine gets in
ROUNDHOUSE_DEVICE_MEMORY_FILE (see engines/launch/environment.py).
"""

import atexit
import json
import logging
import shutil
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

log = logging.getLogger("roundhouse.engine.devices")


@dataclass(frozen=True)
class CardMemory:
    """One card: the names it answers to (UUID, index), and its memory."""

    names: frozenset[str]
    vendor: str
    total_mib: float
    used_mib: float
    # The card's product name where the probe knows it ("NVIDIA H100 80GB HBM3").
    product: str = ""

    @property
    def free_mib(self) -> float:
        return max(self.total_mib - self.used_mib, 0.0)


class MemoryProbe(Protocol):
    def read(self) -> list[CardMemory]: ...


def nvidia_smi_rows(*fields: str) -> list[list[str]]:
    """`nvidia-smi --query-gpu` for these fields: one row of stripped values per
    card; none without nvidia-smi or when it fails."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--query-gpu={','.join(fields)}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=2,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[part.strip() for part in line.split(",")] for line in out.splitlines()]


def amd_cards() -> list[tuple[str, Path]]:
    """AMD cards in sysfs: each card's index and its device folder."""
    cards = []
    for card in sorted(Path("/sys/class/drm").glob("card[0-9]")):
        try:
            if (card / "device" / "vendor").read_text().strip() == "0x1002":
                cards.append((card.name.removeprefix("card"), card / "device"))
        except OSError:
            continue
    return cards


class Nvml:
    """NVIDIA's management library, started once per process on first use and
    shut down at exit. `library()` is None where nvidia-ml-py is not installed
    or NVML does not start (no driver, no card): the probes then read
    nvidia-smi. A failed start is not retried: a machine does not grow a driver
    while an engine runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._library: ModuleType | None = None

    def library(self) -> ModuleType | None:
        with self._lock:
            if not self._started:
                self._started = True
                self._library = self._start()
            return self._library

    @staticmethod
    def _start() -> ModuleType | None:
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            log.info("NVML did not start (%s): reading nvidia-smi instead", error)
            return None
        atexit.register(_shutdown, pynvml)
        return pynvml


def _shutdown(pynvml: ModuleType) -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


# The process's NVML session (nothing is imported or started until a probe reads).
NVML = Nvml()


@dataclass(frozen=True)
class NvmlCard:
    """One card NVML lists: its index, UUID and the handle to query it with."""

    index: int
    uuid: str
    handle: Any

    @property
    def names(self) -> frozenset[str]:
        return frozenset({self.uuid, str(self.index)})


def _text(value: str | bytes) -> str:
    """NVML strings: str in current nvidia-ml-py, bytes in old releases."""
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_cards(nvml: Nvml | None = None) -> tuple[ModuleType, list[NvmlCard]] | None:
    """The library and every card NVML lists (a card NVML cannot name is left
    out); None when NVML is not there or cannot count the cards, so that the
    caller falls back to nvidia-smi."""
    library = (nvml or NVML).library()
    if library is None:
        return None
    try:
        count = library.nvmlDeviceGetCount()
    except library.NVMLError as error:
        log.debug("NVML cannot count the cards (%s): reading nvidia-smi", error)
        return None
    cards = []
    for index in range(count):
        try:
            handle = library.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(library.nvmlDeviceGetUUID(handle))
        except library.NVMLError as error:
            log.debug("NVML cannot read card %d: %s", index, error)
            continue
        cards.append(NvmlCard(index, uuid, handle))
    return library, cards


class NvidiaMemoryProbe:
    """NVIDIA cards through nvidia-smi (absent: no cards)."""

    def read(self) -> list[CardMemory]:
        cards = []
        for row in nvidia_smi_rows("uuid", "index", "memory.total", "memory.used"):
            try:
                total, used = float(row[2]), float(row[3])
            except (IndexError, ValueError):
                continue
            cards.append(CardMemory(frozenset(row[:2]), "nvidia", total, used))
        return cards


class NvmlMemoryProbe:
    """NVIDIA cards through NVML; through `fallback` (nvidia-smi) where NVML
    is not there. A card whose memory NVML cannot read is left out."""

    def __init__(
        self, nvml: Nvml | None = None, fallback: MemoryProbe | None = None
    ) -> None:
        self.nvml = nvml
        self.fallback = fallback if fallback is not None else NvidiaMemoryProbe()

    def read(self) -> list[CardMemory]:
        found = nvml_cards(self.nvml)
        if found is None:
            return self.fallback.read()
        library, listed = found
        cards = []
        for card in listed:
            try:
                memory = library.nvmlDeviceGetMemoryInfo(card.handle)
            except library.NVMLError as error:
                log.debug("NVML cannot read card %s's memory: %s", card.uuid, error)
                continue
            try:
                product = _text(library.nvmlDeviceGetName(card.handle))
            except library.NVMLError:
                product = ""
            # Used is total less free, so that free is NVML's own figure
            # (whether `used` counts the driver's reserved memory has changed
            # between driver releases; free never counts it).
            total_mib = memory.total / 2**20
            used_mib = (memory.total - memory.free) / 2**20
            cards.append(CardMemory(card.names, "nvidia", total_mib, used_mib, product))
        return cards


class AmdMemoryProbe:
    """AMD cards through sysfs (amdgpu's VRAM counters, in bytes)."""

    def read(self) -> list[CardMemory]:
        cards = []
        for name, device in amd_cards():
            try:
                total = int((device / "mem_info_vram_total").read_text())
                used = int((device / "mem_info_vram_used").read_text())
            except (OSError, ValueError):
                continue
            mib = (total / 2**20, used / 2**20)
            cards.append(CardMemory(frozenset({name}), "amd", *mib))
        return cards


class FileMemoryProbe:
    """Cards from a JSON file: {"gpus": [{"id": "GPU-1", "vendor": "nvidia",
    "total_mib": 8192, "used_mib": 512}]}. Stands in for cards this machine does
    not have, through the same interface."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def read(self) -> list[CardMemory]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            return [
                CardMemory(
                    frozenset({str(gpu["id"])}),
                    str(gpu.get("vendor", "nvidia")),
                    float(gpu["total_mib"]),
                    float(gpu["used_mib"]),
                )
                for gpu in data.get("gpus", [])
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []


def default_memory_probes(memory_file: str | None) -> list[MemoryProbe]:
    """The file's cards in tests; else NVIDIA's (NVML, else nvidia-smi) and AMD's."""
    if memory_file:
        return [FileMemoryProbe(memory_file)]
    return [NvmlMemoryProbe(fallback=NvidiaMemoryProbe()), AmdMemoryProbe()]


class DeviceMemory:
    """The memory of the cards an engine owns (its spec's devices, by UUID or
    index; every card when it names none)."""

    def __init__(self, probes: Iterable[MemoryProbe], devices: Iterable[str]) -> None:
        self.probes = list(probes)
        self.devices = {str(device) for device in devices}

    def cards(self) -> list[CardMemory]:
        cards = [card for probe in self.probes for card in probe.read()]
        if not self.devices:
            return cards
        return [card for card in cards if card.names & self.devices]

    def free_mib(self) -> float | None:
        """Free memory over the owned cards; None when there are none."""
        cards = self.cards()
        return sum(card.free_mib for card in cards) if cards else None

    def used_mib(self) -> float | None:
        cards = self.cards()
        return sum(card.used_mib for card in cards) if cards else None
