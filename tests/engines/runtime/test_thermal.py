"""Thermal protection. This machine has no GPU and maybe no sensors, so the tests
drive the engines' probe interface from a temperature file (FileProbe), the way
ROUNDHOUSE_THERMAL_FILE does in production-like runs."""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engines.launch.config import Thresholds
from engines.runtime.thermal import FileProbe, ThermalGate
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import start_engine
from tests.waiting import wait_for

TINY = "tiny-llama"


def write_temperatures(path: Path, *, cpu: float, gpus=()) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(
        json.dumps(
            {
                "cpu": cpu,
                "gpus": [{"id": i, "vendor": v, "celsius": c} for i, v, c in gpus],
            }
        )
    )
    os.replace(partial, path)


def gate_for(path: Path, devices=("GPU-A",), **thresholds) -> ThermalGate:
    return ThermalGate(
        [FileProbe(path)], thresholds=Thresholds.from_dict(thresholds), devices=devices
    )


def test_cpu_pause_and_resume_with_hysteresis(tmp_path):
    """Pause at high; stay paused between resume and high; resume below resume."""
    temps = tmp_path / "t.json"
    gate = gate_for(temps)
    steps = [(70, False), (90, True), (85, True), (80, True), (79, False)]
    for step, (celsius, cooling) in enumerate(steps):
        write_temperatures(temps, cpu=celsius)
        reason = gate.update(now=10.0 * (step + 1))  # a fresh read each time
        assert bool(reason) is cooling, (celsius, reason)
    write_temperatures(temps, cpu=95)
    assert "CPU (cpu) at 95 °C" in gate.update(now=100.0)


def test_only_own_gpus_and_vendor_thresholds_count(tmp_path):
    """A hot card of another engine is ignored; each vendor has its thresholds."""
    temps = tmp_path / "t.json"
    write_temperatures(temps, cpu=50, gpus=[("GPU-B", "nvidia", 99)])
    assert gate_for(temps).update() == ""
    write_temperatures(temps, cpu=50, gpus=[("GPU-A", "amd", 90)])
    assert "GPU GPU-A (amd) at 90 °C" in gate_for(temps).update()
    relaxed = gate_for(temps, overrides={"amd": {"high": 95, "resume": 92}})
    assert relaxed.update() == ""


def test_temperatures_of_own_devices_are_kept_for_the_dashboard(tmp_path):
    """The gate's last reading of each device the engine owns (the CPU and its
    own GPUs, not another engine's card): what its `state` reports."""
    temps = tmp_path / "t.json"
    write_temperatures(
        temps, cpu=51.26, gpus=[("GPU-A", "nvidia", 64), ("GPU-B", "nvidia", 99)]
    )
    gate = gate_for(temps)
    assert gate.temperatures == []  # nothing read yet
    gate.update()
    assert gate.temperatures == [
        {"device": "CPU", "celsius": 51.3},
        {"device": "GPU GPU-A", "celsius": 64.0},
    ]


def test_a_vanished_sensor_does_not_pause_forever(tmp_path):
    temps = tmp_path / "t.json"
    gate = gate_for(temps)
    write_temperatures(temps, cpu=95)
    assert gate.update(now=1000.0)
    temps.unlink()
    assert gate.update(now=2000.0) == ""


@pytest.fixture
def two_engines(tmp_path, tiny_llama, monkeypatch):
    """Two engines reading one temperature file: gpu0 owns GPU-A, cpu0 no GPU."""
    temps = tmp_path / "temps.json"
    write_temperatures(temps, cpu=50, gpus=[("GPU-A", "nvidia", 50)])
    monkeypatch.setenv("ROUNDHOUSE_THERMAL_FILE", str(temps))
    model = {
        "name": TINY,
        "format": "transformers",
        "path": str(tiny_llama),
        "context_length": 256,
        "slots": 2,
    }
    engines = {}
    for name, devices in (("gpu0", ["GPU-A"]), ("cpu0", [])):
        engines[name] = start_engine(
            tmp_path / name, models=[model], preload=[TINY], devices=devices
        )
    yield temps, engines
    for engine in engines.values():
        engine.stop()


def cooling(engine) -> str:
    return engine.client().state().cooling_reason


def queue_depth(engine) -> int:
    return engine.client().state().queue_depth


def test_hot_gpu_pauses_its_engine_and_hot_cpu_pauses_all(two_engines):
    """GPU-A hot: only gpu0 cools. CPU hot: both cool; a request waits, nothing
    decodes, and it completes once the CPU is below its resume threshold."""
    temps, engines = two_engines
    gpu0, cpu0 = engines["gpu0"], engines["cpu0"]

    write_temperatures(temps, cpu=50, gpus=[("GPU-A", "nvidia", 90)])
    wait_for(lambda: "GPU GPU-A (nvidia) at 90 °C" in cooling(gpu0), what="hot GPU")
    assert cooling(cpu0) == ""
    assert (
        cpu0.client()
        .generate(GenerateRequest(model=TINY, prompt="the cat", max_tokens=3))
        .usage
    )

    write_temperatures(temps, cpu=95, gpus=[("GPU-A", "nvidia", 50)])
    wait_for(lambda: "CPU" in cooling(cpu0) and "CPU" in cooling(gpu0), what="hot CPU")
    stream = cpu0.client().generate_stream(
        GenerateRequest(model=TINY, prompt="ships", max_tokens=5, ignore_eos=True)
    )
    # The start frame comes once a slot takes the request: not while cooling.
    waiter = ThreadPoolExecutor(2)
    first = waiter.submit(next, stream)
    wait_for(lambda: queue_depth(cpu0) == 1, what="the request queued")
    steps = cpu0.client().state().models[0].steps
    # A second request, queued behind it, is cancelled: its answer comes back
    # once the decode loop has made a pass (cancels are handled while cooling),
    # a pass that would have taken the first request into a slot had it run.
    probe = waiter.submit(
        cpu0.client().call,
        "generate",
        model=TINY,
        prompt="the cat",
        max_tokens=1,
        request_id="thermal-probe",
    )
    wait_for(lambda: queue_depth(cpu0) == 2, what="the probe queued")
    assert cpu0.client().cancel("thermal-probe")
    probe.result(timeout=60)
    state = cpu0.client().state()
    assert state.models[0].steps == steps  # paused: no decode step ran
    assert state.queue_depth == 1  # the request waits in the queue
    assert not first.done()

    write_temperatures(temps, cpu=85)  # below high, above resume: still cooling
    reason = wait_for(lambda: "at 85 °C" in (r := cooling(cpu0)) and r, what="85 °C")
    assert "cooling until below 80" in reason
    write_temperatures(temps, cpu=60)
    assert first.result(timeout=60).event == "start"
    waiter.shutdown()
    frames = list(stream)
    assert frames[-1].finish_reason == "length"
    assert cooling(cpu0) == ""
    # It reads the file on its own clock.
    wait_for(lambda: cooling(gpu0) == "", what="gpu0 resumed")


def test_vendor_override_pushed_live_changes_the_verdict(two_engines):
    """An AMD card at 90 °C pauses at the default 85; an override of 95 for AMD
    pushed with `configure` resumes the engine without a restart."""
    temps, engines = two_engines
    gpu0 = engines["gpu0"]
    write_temperatures(temps, cpu=50, gpus=[("GPU-A", "amd", 90)])
    wait_for(lambda: "GPU GPU-A (amd)" in cooling(gpu0), what="hot AMD card")
    pid = gpu0.client().ping().pid
    thermal = {"overrides": {"amd": {"high": 95, "resume": 92}}}
    gpu0.client().call("configure", config={"thermal": thermal, "devices": ["GPU-A"]})
    wait_for(lambda: cooling(gpu0) == "", what="resumed")
    assert gpu0.client().ping().pid == pid
