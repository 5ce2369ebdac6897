"""GPU memory: the probes (a stand-in nvidia-smi on PATH, a JSON file) and a
real engine that makes room on its cards.

This machine has no GPU. The engine under test is a `cuda` engine whose card is
described by ROUNDHOUSE_DEVICE_MEMORY_FILE, the same interface nvidia-smi feeds;
its GGUF models run on the CPU (llama.cpp without a GPU backend ignores the
offload), so everything but the card itself is real."""

import json
import os
import stat
from pathlib import Path

import pytest
from django.conf import settings

from engines.launch.devices import DeviceMemory, FileMemoryProbe, NvidiaMemoryProbe
from engines.wire.client import EngineRequestError
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import start_engine

SMI_OUTPUT = """GPU-aaaa, 0, 81559, 1024
GPU-bbbb, 1, 81559, 70000
"""


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch) -> Path:
    """An `nvidia-smi` first on PATH that answers the memory query."""
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{SMI_OUTPUT}EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return script


def test_nvidia_probe_reads_each_card_by_uuid_and_index(fake_nvidia_smi):
    cards = NvidiaMemoryProbe().read()
    assert [sorted(card.names) for card in cards] == [
        ["0", "GPU-aaaa"],
        ["1", "GPU-bbbb"],
    ]
    assert cards[0].free_mib == 81559 - 1024
    assert cards[1].used_mib == 70000


def test_an_engine_counts_only_its_own_cards(fake_nvidia_smi):
    both = DeviceMemory([NvidiaMemoryProbe()], [])
    assert both.free_mib() == (81559 - 1024) + (81559 - 70000)
    second = DeviceMemory([NvidiaMemoryProbe()], ["1"])
    assert second.free_mib() == 81559 - 70000
    assert DeviceMemory([NvidiaMemoryProbe()], ["GPU-cccc"]).free_mib() is None


def test_file_probe_and_a_bad_file(tmp_path):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"id": "G", "total_mib": 8, "used_mib": 3}]}))
    [card] = FileMemoryProbe(path).read()
    assert (card.names, card.free_mib) == (frozenset({"G"}), 5)
    path.write_text("{not json")
    assert FileMemoryProbe(path).read() == []


def smollm(name: str, device_mib: int) -> dict:
    return {
        "name": name,
        "format": "gguf",
        "path": str(Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "context_length": 256,
        "slots": 1,
        "measured_device_mib": device_mib,
    }


@pytest.fixture
def gpu_engine(tmp_path, monkeypatch):
    """A cuda engine owning card GPU-1 (1000 MiB, 100 used), margin 10 MiB."""
    card = tmp_path / "gpus.json"
    monkeypatch.setenv("ROUNDHOUSE_DEVICE_MEMORY_FILE", str(card))
    engine = start_engine(
        tmp_path,
        backend="cuda",
        devices=["GPU-1"],
        limits={"memory_margin_mib": 10, "models_max": 5, "queue_timeout_s": 2},
        models=[smollm("a", 400), smollm("b", 400), smollm("c", 400)]
        # Every layer asked on the card: too large, refused (auto would load
        # it partly offloaded, tests/engines/runtime/test_offload_engine.py).
        + [{**smollm("huge", 5000), "gpu_layers": "all"}],
    )
    engine.card = card
    engine.set_used = lambda used: card.write_text(
        json.dumps({"gpus": [{"id": "GPU-1", "total_mib": 1000, "used_mib": used}]})
    )
    engine.set_used(100)
    yield engine
    engine.stop()


def resident(engine) -> dict[str, float]:
    return {m.name: m.device_memory_mib for m in engine.client().state().models}


def test_loads_evict_by_device_memory_lru_first(gpu_engine):
    """Two 400 MiB models fit on the card; the third evicts the least recently
    used one, though models-max (5) and host RAM have room to spare."""

    def use(name):
        request = GenerateRequest(model=name, prompt="hi", max_tokens=1)
        return gpu_engine.client().generate(request)

    use("a")
    gpu_engine.set_used(500)  # what a real card would now show
    use("b")
    gpu_engine.set_used(900)
    use("a")  # b is now the least recently used
    use("c")
    assert resident(gpu_engine) == {"a": 400.0, "c": 400.0}


def test_a_model_larger_than_the_card_fails_at_once(gpu_engine):
    with pytest.raises(EngineRequestError) as error:
        gpu_engine.client().generate(
            GenerateRequest(model="huge", prompt="hi", max_tokens=1)
        )
    assert error.value.code == "insufficient_memory"
    assert "of GPU memory" in error.value.message
    assert "short by" in error.value.message
