"""Thermal protection: temperature probes and the gate that pauses an engine.

A hot CPU pauses every engine (each engine reads the CPU); a hot GPU pauses only
the engine that owns it (each engine judges only its own cards). Each card is
judged by its vendor's thresholds (engines/launch/config.py Thresholds). Work
pauses at `high` and resumes only below `resume` (hysteresis), so an engine does
not flap around one temperature.
Sensors are read without torch: psutil, NVML (nvidia-smi where NVML is not
there), sysfs; tests drive the same interface from a JSON file
(ROUNDHOUSE_THERMAL_FILE, see engines/launch/environment.py).
"""

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from engines.launch.config import Thresholds
from engines.launch.devices import Nvml, amd_cards, nvidia_smi_rows, nvml_cards

log = logging.getLogger("roundhouse.engine.thermal")

READ_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Reading:
    """One temperature: the CPU package, or one GPU (by UUID or index)."""

    kind: str  # "cpu" or "gpu"
    device: str
    vendor: str
    celsius: float


class Probe(Protocol):
    def read(self) -> list[Reading]: ...


class CpuProbe:
    """The hottest CPU package/core sensor psutil knows (none on many VMs)."""

    NAMES = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "acpitz")

    def read(self) -> list[Reading]:
        sensors = getattr(psutil, "sensors_temperatures", lambda: {})() or {}
        values = [
            entry.current
            for name in self.NAMES
            for entry in sensors.get(name, [])
            if entry.current
        ]
        return [Reading("cpu", "cpu", "cpu", max(values))] if values else []


class NvidiaProbe:
    """NVIDIA cards through nvidia-smi (absent: no readings)."""

    def read(self) -> list[Reading]:
        readings = []
        for row in nvidia_smi_rows("uuid", "index", "temperature.gpu"):
            if len(row) == 3 and row[2].replace(".", "", 1).isdigit():
                readings.append(Reading("gpu", row[0], "nvidia", float(row[2])))
                readings.append(Reading("gpu", row[1], "nvidia", float(row[2])))
        return readings


class NvmlProbe:
    """NVIDIA cards through NVML, one reading by UUID and one by index per
    card; through `fallback` (nvidia-smi) where NVML is not there. A card whose
    temperature NVML cannot read is left out; the others are still read."""

    def __init__(self, nvml: Nvml | None = None, fallback: Probe | None = None) -> None:
        self.nvml = nvml
        self.fallback = fallback if fallback is not None else NvidiaProbe()

    def read(self) -> list[Reading]:
        found = nvml_cards(self.nvml)
        if found is None:
            return self.fallback.read()
        library, cards = found
        readings = []
        for card in cards:
            try:
                celsius = float(
                    library.nvmlDeviceGetTemperature(
                        card.handle, library.NVML_TEMPERATURE_GPU
                    )
                )
            except library.NVMLError as error:
                log.debug(
                    "NVML cannot read card %s's temperature: %s", card.uuid, error
                )
                continue
            readings.append(Reading("gpu", card.uuid, "nvidia", celsius))
            readings.append(Reading("gpu", str(card.index), "nvidia", celsius))
        return readings


class AmdProbe:
    """AMD cards through sysfs hwmon (edge temperature)."""

    def read(self) -> list[Reading]:
        readings = []
        for name, device in amd_cards():
            try:
                sensor = next((device / "hwmon").glob("hwmon*/temp1_input"))
                celsius = int(sensor.read_text()) / 1000
            except (OSError, StopIteration, ValueError):
                continue
            readings.append(Reading("gpu", name, "amd", celsius))
        return readings


class FileProbe:
    """Temperatures from a JSON file: {"cpu": 71, "gpus": [{"id": "GPU-1",
    "vendor": "nvidia", "celsius": 80}]}. Stands in for sensors this machine
    does not have, through the same interface."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def read(self) -> list[Reading]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        readings = []
        if isinstance(data.get("cpu"), (int, float)):
            readings.append(Reading("cpu", "cpu", "cpu", float(data["cpu"])))
        for gpu in data.get("gpus", []):
            readings.append(
                Reading(
                    "gpu", str(gpu["id"]), str(gpu["vendor"]), float(gpu["celsius"])
                )
            )
        return readings


def default_probes(thermal_file: str | None) -> list[Probe]:
    if thermal_file:
        return [FileProbe(thermal_file)]
    return [CpuProbe(), NvmlProbe(fallback=NvidiaProbe()), AmdProbe()]


class ThermalGate:
    """Decides whether this engine may run work now, from its probes."""

    def __init__(
        self,
        probes: Iterable[Probe],
        *,
        thresholds: Thresholds | None = None,
        devices: Iterable[str] = (),
    ) -> None:
        self.probes = list(probes)
        self.thresholds = thresholds or Thresholds()
        self.devices = set(devices)
        self.hot: dict[tuple[str, str], str] = {}  # (kind, device) -> reason
        # The last temperatures of this engine's devices: label -> °C.
        self.readings: dict[str, float] = {}
        self._read_at = 0.0

    def configure(self, *, thresholds: Thresholds, devices: Iterable[str]) -> None:
        self.thresholds = thresholds
        self.devices = set(devices)
        self._read_at = 0.0  # judge again at once

    @property
    def reason(self) -> str:
        """Why the engine is cooling ('' when it is not)."""
        return "; ".join(self.hot[key] for key in sorted(self.hot))

    @property
    def temperatures(self) -> list[dict]:
        """The last reading of each of this engine's devices (the dashboard's)."""
        return [
            {"device": label, "celsius": celsius}
            for label, celsius in sorted(self.readings.items())
        ]

    def update(self, now: float | None = None) -> str:
        """Read the probes (at most once a second) and return the cooling reason."""
        now = time.monotonic() if now is None else now
        if now - self._read_at < READ_INTERVAL_S:
            return self.reason
        self._read_at = now
        readings = [r for probe in self.probes for r in probe.read()]
        seen = set()
        temperatures = {}
        for reading in readings:
            if reading.kind == "gpu" and reading.device not in self.devices:
                continue  # another engine's card
            key = (reading.kind, reading.device)
            seen.add(key)
            high, resume = self.thresholds.for_device(reading.kind, reading.vendor)
            label = "CPU" if reading.kind == "cpu" else f"GPU {reading.device}"
            temperatures[label] = round(reading.celsius, 1)
            if reading.celsius >= high:
                self.hot[key] = (
                    f"{label} ({reading.vendor}) at {reading.celsius:g} °C "
                    f"(pause at {high:g}, resume below {resume:g})"
                )
            elif key in self.hot and reading.celsius < resume:
                del self.hot[key]
                log.info("%s cooled to %g °C: resuming", label, reading.celsius)
            elif key in self.hot:
                self.hot[key] = (
                    f"{label} ({reading.vendor}) at {reading.celsius:g} °C, "
                    f"cooling until below {resume:g}"
                )
        for key in list(self.hot):
            if key not in seen:  # the sensor went away: do not pause forever
                del self.hot[key]
        self.readings = temperatures
        return self.reason
