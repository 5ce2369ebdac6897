"""The engine's watch (engines/runtime/watcher.py) as a unit, in this process:
a ThermalGate reading a temperature file (FileProbe: this machine's sensors
cannot be heated), a Residency holding the tiny Llama, and the `set_allowed`
callback recording each pass's verdict. The watch passes about once a second
(READ_INTERVAL_S): each pass calls `set_allowed` once, so the tests count
passes by its calls instead of waiting for a while."""

import asyncio
import json
import logging
import threading
import time

import pytest

from engines.generation.runner import DecodeThread, GenerationRequest, GenerationRunner
from engines.generation.sampling import SamplingParams
from engines.launch.config import EngineConfig, Limits, ModelSpec
from engines.launch.devices import DeviceMemory
from engines.runtime.residency import Residency
from engines.runtime.thermal import FileProbe, ThermalGate
from engines.runtime.watcher import watch
from tests.engines.counting_backend import CountingBackend


class Verdicts:
    """What each pass of the watch decided: allowed to compute or not."""

    def __init__(self) -> None:
        self.seen: asyncio.Queue[bool] = asyncio.Queue()

    def __call__(self, allowed: bool) -> None:
        self.seen.put_nowait(allowed)

    async def next(self) -> bool:
        """The next pass's verdict (a pass comes about once a second)."""
        return await asyncio.wait_for(self.seen.get(), 30)

    async def until(self, holds, *, passes: int = 10) -> None:
        """Let passes go by until `holds(verdict)` is true after one of them;
        fail if it is not within `passes` passes."""
        for _ in range(passes):
            if holds(await self.next()):
                return
        raise AssertionError(f"not so after {passes} passes of the watch")


def temperatures(path, *, cpu: float) -> None:
    path.write_text(json.dumps({"cpu": cpu}))


def residency_of(*specs: ModelSpec, **limits) -> Residency:
    config = EngineConfig(
        name="unit",
        port=0,
        limits=Limits(**limits),
        models={spec.name: spec for spec in specs},
    )
    allowed, allowed_async = threading.Event(), asyncio.Event()
    allowed.set(), allowed_async.set()
    return Residency(
        config,
        allowed=allowed,
        allowed_async=allowed_async,
        device_memory=DeviceMemory([], []),
    )


@pytest.fixture
async def watching():
    """Start `watch` over a gate and a residency; cancelled at the end."""
    tasks: list[asyncio.Task] = []

    def start(gate: ThermalGate, residency: Residency) -> Verdicts:
        verdicts = Verdicts()
        tasks.append(asyncio.create_task(watch(gate, verdicts, residency)))
        return verdicts

    yield start
    for task in tasks:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_hot_cpu_pauses_and_a_cool_one_resumes(watching, tmp_path):
    """Each pass reads the temperatures: at 95 °C work pauses; below the
    resume threshold (80) it resumes, at the next pass."""
    path = tmp_path / "temperatures.json"
    temperatures(path, cpu=95)
    verdicts = watching(ThermalGate([FileProbe(path)]), residency_of())
    assert await verdicts.next() is False
    temperatures(path, cpu=60)
    # The gate reads the file at most once a second: a pass may still judge
    # by the last reading; the one after reads it.
    await verdicts.until(lambda allowed: allowed, passes=3)


async def test_a_broken_sensor_does_not_stop_the_watch(watching, caplog):
    """A probe that raises is logged, counts as no reason to pause, and the
    watch goes on to its next pass."""

    class BrokenProbe:
        """A sensor whose driver fails on every read."""

        def read(self):
            raise OSError("sensor unplugged")

    verdicts = watching(ThermalGate([BrokenProbe()]), residency_of())
    assert [await verdicts.next(), await verdicts.next()] == [True, True]
    assert "reading temperatures failed" in caplog.text
    assert "sensor unplugged" in caplog.text


async def test_idle_models_past_their_keep_alive_are_unloaded(
    watching, tiny_llama, tmp_path
):
    """A pass unloads a model idle past its keep-alive; one with no keep-alive
    limit (0) stays: the control."""
    spec = {"format": "transformers", "path": str(tiny_llama), "slots": 1}
    residency = residency_of(
        ModelSpec(name="brief", keep_alive_s=1, **spec),
        ModelSpec(name="forever", keep_alive_s=0, **spec),
    )
    for name in ("brief", "forever"):
        model = await residency.ensure_loaded(name)
        model.last_used = time.monotonic() - 3600
    verdicts = watching(ThermalGate([FileProbe(tmp_path / "none.json")]), residency)
    await verdicts.next()  # a pass: it unloads before its next one
    await verdicts.next()
    assert list(residency.models) == ["forever"]
    await residency.unload_all()


async def test_a_stuck_decode_loop_is_reported_once_then_its_recovery(
    watching, tmp_path, caplog
):
    """A decode loop with work and no pass for longer than the stuck limit
    makes the watch log the engine unhealthy, once however many passes see
    it; once the loop passes again, it logs the engine healthy again. (The
    stand-in backend blocks its step as a hung kernel would.)"""
    residency = residency_of(stuck_after_s=0.2)
    residency.decoder = DecodeThread(max_parallel=4)
    backend = CountingBackend()
    runner = GenerationRunner(
        backend, name="m", queue_limit=4, queue_timeout_s=30, decoder=residency.decoder
    )
    verdicts = watching(ThermalGate([FileProbe(tmp_path / "none.json")]), residency)
    await verdicts.next()
    assert "unhealthy" not in caplog.text  # the control: idle is healthy
    backend.block.clear()
    finished = threading.Event()
    runner.submit(
        GenerationRequest(
            prompt_tokens=[1, 2],
            params=SamplingParams(max_tokens=2),
            emit=lambda event: event["event"] == "done" and finished.set(),
        )
    )
    await verdicts.until(lambda _: "engine unhealthy" in caplog.text)
    await verdicts.next(), await verdicts.next()  # two more passes see it stuck
    assert caplog.text.count("engine unhealthy: the decode loop is stuck") == 1
    backend.block.set()
    await verdicts.until(lambda _: "engine healthy again" in caplog.text)
    assert await asyncio.to_thread(finished.wait, 10)  # and the request ends
    await asyncio.to_thread(runner.close, 10)


@pytest.fixture(autouse=True)
def engine_log(caplog):
    caplog.set_level(logging.INFO, logger="roundhouse.engine")
