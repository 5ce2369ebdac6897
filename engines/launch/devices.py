"""Device (GPU) memory: what each card has and uses, read without torch.

NVIDIA cards through `nvidia-smi --query-gpu`, AMD cards through sysfs
(`mem_info_vram_total` / `mem_info_vram_used`). Machines without a GPU read
nothing; tests drive the same interface from a JSON file whose path the engine
gets in ROUNDHOUSE_DEVICE_MEMORY_FILE (see engines/launch/environment.py).
"""

import json
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class CardMemory:
    """One card: the names it answers to (UUID, index), and its memory."""

    names: frozenset[str]
    vendor: str
    total_mib: float
    used_mib: float

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
    if memory_file:
        return [FileMemoryProbe(memory_file)]
    return [NvidiaMemoryProbe(), AmdMemoryProbe()]


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
