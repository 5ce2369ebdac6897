"""NVIDIA cards through NVML: memory and temperature by UUID and index, and the
fall back to nvidia-smi where NVML is missing or does not start.

This machine has no NVIDIA card and no nvidia-ml-py. A stand-in `pynvml`
module, put in sys.modules, answers through the same functions, constants,
error class and return shapes as nvidia-ml-py's: memory info in bytes with
.total/.free/.used, UUIDs and names as str (current releases) or bytes (old
ones), an NVMLError carrying NVML's error code."""

import os
import stat
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from engines.launch import devices
from engines.launch.config import Thresholds
from engines.launch.devices import (
    DeviceMemory,
    NvidiaMemoryProbe,
    Nvml,
    NvmlMemoryProbe,
    default_memory_probes,
)
from engines.runtime.thermal import NvidiaProbe, NvmlProbe, ThermalGate
from tests.conftest import ROOT

MIB = 2**20

# NVML's error codes (nvml.h) the stand-in raises.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15


class FakeCard:
    """One card as the stand-in library holds it."""

    def __init__(self, uuid, name, total_mib, free_mib, celsius):
        self.uuid, self.name, self.celsius = uuid, name, celsius
        self.total, self.free = total_mib * MIB, free_mib * MIB


def fake_pynvml(cards: list[FakeCard], *, init_error: int | None = None):
    """A module shaped like nvidia-ml-py's `pynvml`, over these cards. Its
    `calls` counts nvmlInit and nvmlShutdown; a card's `celsius` or `total`
    set to an error code makes that query raise NVMLError."""
    module = types.ModuleType("pynvml")
    module.calls = {"init": 0, "shutdown": 0}

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:
            return f"NVML error {self.value}"

    def init():
        module.calls["init"] += 1
        if init_error is not None:
            raise NVMLError(init_error)

    def shutdown():
        module.calls["shutdown"] += 1

    def handle_by_index(index):
        if not 0 <= index < len(cards):
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return SimpleNamespace(card=cards[index])  # real handles are pointers

    def memory_info(handle):
        card = handle.card
        if isinstance(card.total, Exception):
            raise card.total
        used = card.total - card.free
        return SimpleNamespace(total=card.total, free=card.free, used=used)

    def temperature(handle, sensor):
        assert sensor == module.NVML_TEMPERATURE_GPU
        if isinstance(handle.card.celsius, Exception):
            raise handle.card.celsius
        return handle.card.celsius

    module.NVMLError = NVMLError
    module.NVML_TEMPERATURE_GPU = 0
    module.nvmlInit = init
    module.nvmlShutdown = shutdown
    module.nvmlDeviceGetCount = lambda: len(cards)
    module.nvmlDeviceGetHandleByIndex = handle_by_index
    module.nvmlDeviceGetUUID = lambda handle: handle.card.uuid
    module.nvmlDeviceGetName = lambda handle: handle.card.name
    module.nvmlDeviceGetMemoryInfo = memory_info
    module.nvmlDeviceGetTemperature = temperature
    return module


def two_cards() -> list[FakeCard]:
    """Two unequal cards; the second answers in bytes, as old releases do."""
    return [
        FakeCard("GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559, 80535, 45),
        FakeCard(b"GPU-bbbb", b"NVIDIA L4", 23034, 3034, 70),
    ]


@pytest.fixture
def install(monkeypatch):
    """Put a stand-in pynvml in sys.modules and give the process a fresh NVML
    session (the shared one would remember an earlier test's library)."""

    def install(module):
        monkeypatch.setitem(sys.modules, "pynvml", module)
        monkeypatch.setattr(devices, "NVML", Nvml())
        return module

    return install


@pytest.fixture
def no_nvidia_smi(tmp_path, monkeypatch):
    """A PATH with no nvidia-smi on it."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An nvidia-smi first on PATH that lists one card, GPU-smi (index 0)."""
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho 'GPU-smi, 0, 1000, 400'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")


def test_reads_each_card_by_uuid_and_index_in_mib(install):
    install(fake_pynvml(two_cards()))
    first, second = NvmlMemoryProbe().read()
    assert first.names == frozenset({"GPU-aaaa", "0"})
    assert second.names == frozenset({"GPU-bbbb", "1"})  # bytes decoded
    assert (first.total_mib, first.free_mib, first.used_mib) == (81559, 80535, 1024)
    assert (second.free_mib, second.product) == (3034, "NVIDIA L4")
    assert first.vendor == second.vendor == "nvidia"


def test_an_engine_matches_its_cards_by_uuid_or_index(install):
    install(fake_pynvml(two_cards()))
    assert DeviceMemory([NvmlMemoryProbe()], ["GPU-bbbb"]).free_mib() == 3034
    assert DeviceMemory([NvmlMemoryProbe()], ["1"]).free_mib() == 3034
    assert DeviceMemory([NvmlMemoryProbe()], []).free_mib() == 80535 + 3034
    # Control: a card this host does not have matches nothing.
    assert DeviceMemory([NvmlMemoryProbe()], ["GPU-cccc"]).free_mib() is None


def test_nvml_is_started_once_per_process(install):
    library = install(fake_pynvml(two_cards()))
    probe = NvmlMemoryProbe()
    for _ in range(3):
        assert len(probe.read()) == 2
    assert len(NvmlProbe().read()) == 4  # the thermal probe shares the session
    assert library.calls == {"init": 1, "shutdown": 0}


def test_init_error_falls_back_to_nvidia_smi(install, no_nvidia_smi):
    """NVML does not start (no driver): the nvidia-smi probe reads instead,
    and finds nothing here."""
    library = install(fake_pynvml(two_cards(), init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    assert NvmlMemoryProbe(fallback=NvidiaMemoryProbe()).read() == []
    assert NvmlProbe(fallback=NvidiaProbe()).read() == []
    assert DeviceMemory(default_memory_probes(None), ["GPU-aaaa"]).free_mib() is None
    assert library.calls["init"] == 1  # a failed start is not retried


def test_init_error_reads_what_nvidia_smi_lists(install, fake_nvidia_smi):
    """Control for the fall back: nvidia-smi's cards are what is read."""
    install(fake_pynvml(two_cards(), init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    [card] = NvmlMemoryProbe(fallback=NvidiaMemoryProbe()).read()
    assert (card.names, card.free_mib) == (frozenset({"GPU-smi", "0"}), 600)


def test_without_the_binding_nvidia_smi_reads(monkeypatch, fake_nvidia_smi):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml fails
    monkeypatch.setattr(devices, "NVML", Nvml())
    [card] = NvmlMemoryProbe().read()
    assert card.names == frozenset({"GPU-smi", "0"})


def test_the_default_probes_read_nvml_first(install, fake_nvidia_smi):
    """Where NVML works, nvidia-smi is not read (its GPU-smi is not listed)."""
    install(fake_pynvml(two_cards()))
    names = {n for p in default_memory_probes(None) for c in p.read() for n in c.names}
    assert {"GPU-aaaa", "GPU-bbbb"} <= names
    assert "GPU-smi" not in names


def test_a_card_whose_memory_errs_is_left_out(install):
    cards = two_cards()
    install(fake_pynvml(cards))
    cards[0].total = devices.NVML.library().NVMLError(NVML_ERROR_GPU_IS_LOST)
    [card] = NvmlMemoryProbe().read()
    assert "GPU-bbbb" in card.names


def test_one_card_erring_on_temperature_leaves_the_others(install):
    cards = two_cards()
    library = install(fake_pynvml(cards))
    assert {r.device: r.celsius for r in NvmlProbe().read()} == {
        "GPU-aaaa": 45,
        "0": 45,
        "GPU-bbbb": 70,
        "1": 70,
    }
    cards[0].celsius = library.NVMLError(NVML_ERROR_NOT_SUPPORTED)
    readings = NvmlProbe().read()
    assert {r.device: r.celsius for r in readings} == {"GPU-bbbb": 70, "1": 70}
    assert {r.vendor for r in readings} == {"nvidia"}


def test_a_hot_card_named_by_uuid_pauses_its_engine(install):
    cards = two_cards()
    install(fake_pynvml(cards))
    gate = ThermalGate([NvmlProbe()], thresholds=Thresholds(), devices=["GPU-bbbb"])
    assert gate.update(now=1.0) == ""
    assert gate.temperatures == [{"device": "GPU GPU-bbbb", "celsius": 70}]
    cards[1].celsius = 99
    assert "GPU GPU-bbbb (nvidia) at 99 °C" in gate.update(now=2.0)
    # Control: an engine owning only the other card is not paused.
    other = ThermalGate([NvmlProbe()], thresholds=Thresholds(), devices=["0"])
    assert other.update(now=1.0) == ""


def test_importing_the_probes_does_not_import_pynvml(tmp_path):
    """The binding is imported when a probe first reads, not at import."""
    stand_in = tmp_path / "pynvml.py"
    stand_in.write_text(
        "import pathlib, sys\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).touch()\n"
        "class NVMLError(Exception): pass\n"
        "def nvmlInit(): raise NVMLError(9)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}

    def run(code: str) -> None:
        subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True)

    run("import engines.launch.devices, engines.runtime.thermal")
    assert not (tmp_path / "imported").exists()
    # Control: a read imports it.
    run("from engines.launch.devices import NVML; assert NVML.library() is None")
    assert (tmp_path / "imported").exists()
