"""Residency (engines/runtime/residency.py) as a unit, in this process: the
tiny Llama the tests build, loaded for real under several names (and the
bundled MiniLM embedder where a micro-batcher is the point); GPU memory from a
file (FileMemoryProbe), as this machine has no card. Leases are taken with
`using`, as the server takes them for a request. (The same through a real
engine process: test_residency.py.)"""

import asyncio
import json
import threading
import time

import pytest

from engines.launch.config import EngineConfig, Limits, ModelSpec
from engines.launch.devices import DeviceMemory, FileMemoryProbe
from engines.runtime import residency as residency_module
from engines.runtime.residency import Residency
from engines.wire.errors import ProtocolError
from tests.engines.conftest import embedder_spec
from tests.waiting import await_for, suspended_in

# Memory as an earlier load measured it: a load with it decides at once (no
# estimate read off the event loop), so once `loading` names a model, its
# load has decided whether to evict or to wait.
MEASURED_MIB = 64


def tiny(name: str, path, **extra) -> ModelSpec:
    fields = {"context_length": 128, "slots": 1, "measured_mib": MEASURED_MIB}
    return ModelSpec(
        name=name, format="transformers", path=str(path), **{**fields, **extra}
    )


@pytest.fixture
async def make(tiny_llama):
    """Residency(config) for a test, with the tiny Llama as a, b and c unless
    told otherwise; every model it holds is unloaded at the end."""
    made: list[Residency] = []

    def residency(*specs, backend="cpu", cards=None, **limits) -> Residency:
        specs = specs or tuple(tiny(name, tiny_llama) for name in "abc")
        config = EngineConfig(
            name="unit",
            port=0,
            backend=backend,
            limits=Limits(**limits),
            models={spec.name: spec for spec in specs},
        )
        allowed, allowed_async = threading.Event(), asyncio.Event()
        allowed.set(), allowed_async.set()
        probes = [FileMemoryProbe(cards)] if cards else []
        made.append(
            Residency(
                config,
                allowed=allowed,
                allowed_async=allowed_async,
                device_memory=DeviceMemory(probes, []),
            )
        )
        return made[-1]

    yield residency
    for residency in made:
        await residency.unload_all()


async def use(residency: Residency, name: str) -> None:
    """One request's lease of the model, given back at once."""
    async with residency.using(name):
        pass


class Lease:
    """A lease held in a task of its own until `release`."""

    def __init__(self, residency: Residency, name: str) -> None:
        self.taken, self.done = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(self._hold(residency, name))

    async def _hold(self, residency: Residency, name: str) -> None:
        async with residency.using(name):
            self.taken.set()
            await self.done.wait()

    async def release(self) -> None:
        self.done.set()
        await self.task


async def test_a_model_is_loaded_once_whoever_asks(make):
    """Two requests for a model that is not resident share one load."""
    residency = make()
    first, second = await asyncio.gather(
        residency.ensure_loaded("a"), residency.ensure_loaded("a")
    )
    assert first is second
    assert list(residency.models) == ["a"]


async def test_a_model_not_configured_is_unknown(make):
    """A model the engine was not given is unknown_model; nothing loads."""
    residency = make()
    with pytest.raises(ProtocolError) as error:
        await residency.ensure_loaded("zeta")
    assert error.value.code == "unknown_model"
    assert residency.models == {}


async def test_models_max_evicts_the_least_recently_used(make):
    """With room for two, loading a third evicts the one used longest ago."""
    residency = make(models_max=2)
    await use(residency, "a")
    await use(residency, "b")
    await use(residency, "a")  # b is now the least recently used
    await use(residency, "c")
    assert sorted(residency.models) == ["a", "c"]


async def test_a_leased_model_is_never_evicted_the_load_waits(make):
    """models-max 1 and `a` leased: a load of `b` waits, `a` stays; once the
    lease is given back, `a` is evicted and `b` loads."""
    residency = make(models_max=1)
    lease = Lease(residency, "a")
    await lease.taken.wait()
    load = asyncio.create_task(residency.ensure_loaded("b"))
    await await_for(lambda: residency.loading == {"b"}, what="b loading")
    assert list(residency.models) == ["a"]  # decided: leased, not evicted
    assert not load.done()
    await lease.release()
    assert (await load).spec.name == "b"
    assert list(residency.models) == ["b"]


async def test_waiting_for_room_is_bounded_by_the_queue_timeout(make):
    """If the leased model stays leased past the queue timeout, the load fails
    with insufficient_memory, and the leased model stays."""
    residency = make(models_max=1, queue_timeout_s=0.2)
    lease = Lease(residency, "a")
    await lease.taken.wait()
    with pytest.raises(ProtocolError) as error:
        await residency.ensure_loaded("b")
    assert error.value.code == "insufficient_memory"
    assert "stayed busy" in error.value.message
    assert list(residency.models) == ["a"]
    await lease.release()


async def test_a_model_that_can_never_fit_is_refused_naming_the_shortfall(make):
    """A margin larger than the machine: refused at once (not after the queue
    timeout), naming the host memory short; nothing loaded. The control: the
    default margin loads it."""
    huge = make(memory_margin_mib=10**7, queue_timeout_s=3600)
    with pytest.raises(ProtocolError) as error:
        await asyncio.wait_for(huge.ensure_loaded("a"), 60)
    assert error.value.code == "insufficient_memory"
    assert "of host memory" in error.value.message
    assert "short by" in error.value.message
    assert huge.models == {}
    assert (await make().ensure_loaded("a")).spec.name == "a"


def cards_file(tmp_path, *, total_mib: float, used_mib: float):
    path = tmp_path / "cards.json"
    card = {"id": "GPU-0", "total_mib": total_mib, "used_mib": used_mib}
    path.write_text(json.dumps({"gpus": [card]}))
    return path


async def test_a_gpu_engine_needs_room_on_its_cards(make, tmp_path, models_dir):
    """On a GPU engine the model's measured card memory must fit the cards'
    free memory (less the margin): a GGUF model told to go all on the cards
    (gpu_layers all: never partly offloaded), 500 MiB on a card with 100 free,
    is refused naming the GPU shortfall. The control: a card with room loads
    it (this llama.cpp build runs the layers on the CPU: the card shows no
    growth)."""
    spec = ModelSpec(
        name="a",
        format="gguf",
        task="chat",
        path=str(models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        context_length=128,
        slots=1,
        measured_mib=MEASURED_MIB,
        measured_device_mib=500,
        gpu_layers="all",
    )
    full = cards_file(tmp_path, total_mib=8192, used_mib=8092)
    residency = make(spec, backend="vulkan", cards=full, memory_margin_mib=0)
    with pytest.raises(ProtocolError) as error:
        await residency.ensure_loaded("a")
    assert error.value.code == "insufficient_memory"
    assert "500 MiB of GPU memory" in error.value.message
    assert "short by 400 MiB" in error.value.message
    roomy = cards_file(tmp_path, total_mib=8192, used_mib=0)
    residency = make(spec, backend="vulkan", cards=roomy, memory_margin_mib=0)
    model = await residency.ensure_loaded("a")
    assert model.device_mib == 500  # the card showed no growth: as measured


async def test_what_a_load_took_on_each_card_is_measured_and_described(
    make, tmp_path, models_dir, monkeypatch
):
    """A GPU engine measures what a load took on each of its cards (the cards'
    use before and after it) and describes it in `state` by the cards' plan
    labels: a load that grows GPU-0 by 300 MiB and leaves GPU-1 as it was
    reads {"GPU-0": 300}. The control: a load that grows no card describes
    none (the model's card memory then falls back to its measured figure)."""
    path = tmp_path / "cards.json"

    def write(used_0: float) -> None:
        path.write_text(
            json.dumps(
                {
                    "gpus": [
                        {"id": "GPU-0", "total_mib": 8192, "used_mib": used_0},
                        {"id": "GPU-1", "total_mib": 8192, "used_mib": 100},
                    ]
                }
            )
        )

    grow = {"by": 300.0}
    real_load = residency_module.load_backend

    def load_and_grow(*args, **kwargs):
        backend = real_load(*args, **kwargs)
        write(1000 + grow["by"])  # the runtime's allocations, as a card shows them
        return backend

    monkeypatch.setattr(residency_module, "load_backend", load_and_grow)
    spec = ModelSpec(
        name="a",
        format="gguf",
        task="chat",
        path=str(models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        context_length=128,
        slots=1,
        measured_mib=MEASURED_MIB,
        measured_device_mib=50,
    )
    write(1000)
    model = await make(spec, backend="cuda", cards=path).ensure_loaded("a")
    assert model.device_cards_mib == {"GPU-0": 300}
    assert model.device_mib == 300
    assert model.describe()["device_cards_mib"] == {"GPU-0": 300}

    grow["by"] = 0.0
    write(1000)
    model = await make(spec, backend="cuda", cards=path).ensure_loaded("a")
    assert model.device_cards_mib == {}
    assert "device_cards_mib" not in model.describe()
    assert model.device_mib == 50  # no growth: as measured before


async def test_a_transformers_model_needs_no_card_where_torch_uses_none(
    make, tiny_llama, tmp_path
):
    """A Vulkan engine runs a transformers model on the CPU (torch has no
    Vulkan device): a full card does not refuse it, the host holds it. The
    control is the GGUF model above, refused on the same full card."""
    spec = tiny("a", tiny_llama, measured_device_mib=500)
    full = cards_file(tmp_path, total_mib=8192, used_mib=8092)
    residency = make(spec, backend="vulkan", cards=full, memory_margin_mib=0)
    model = await residency.ensure_loaded("a")
    assert model.spec.name == "a" and "a" in residency.models


async def test_keep_alive_unloads_idle_models_only(make, tiny_llama):
    """Past its keep-alive an idle model is unloaded; a leased one never is,
    however long since it was last used; keep-alive 0 means no limit."""
    residency = make(
        tiny("idle", tiny_llama, keep_alive_s=1),
        tiny("leased", tiny_llama, keep_alive_s=1),
        tiny("forever", tiny_llama, keep_alive_s=0),
    )
    for name in ("idle", "forever"):
        await use(residency, name)
    lease = Lease(residency, "leased")
    await lease.taken.wait()
    long_ago = time.monotonic() - 3600
    for model in residency.models.values():
        model.last_used = long_ago
    await residency.expire_idle()
    assert sorted(residency.models) == ["forever", "leased"]
    await lease.release()


async def test_a_requests_keep_alive_decides_how_long_the_model_stays(make):
    """The last request's keep-alive (Ollama's) replaces the model's own: 0
    unloads it once idle, below 0 keeps it however long it idles, and a
    request that asks nothing brings back the model's own (300 s here).
    Control: the same idle model with its own keep-alive stays."""
    residency = make()  # a, b, c: keep-alive 300 s
    async with residency.using("a", keep_alive_s=0):
        pass
    await use(residency, "b")
    async with residency.using("c", keep_alive_s=-1):
        pass
    assert residency.models["c"].keep_alive_limit() is None
    residency.models["c"].last_used = time.monotonic() - 3600
    await residency.expire_idle()
    assert sorted(residency.models) == ["b", "c"]
    await use(residency, "c")  # asks nothing: its own 300 s again
    assert residency.models["c"].describe()["keep_alive_s"] == 300
    residency.models["c"].last_used = time.monotonic() - 3600
    await residency.expire_idle()
    assert sorted(residency.models) == ["b"]


async def test_a_model_kept_until_its_memory_is_needed_ignores_requests(
    make, tiny_llama
):
    """A model whose own keep-alive is 0 (an operator's choice, or a replica
    placed on the engine) stays whatever a request or an unload `when_idle`
    asks (keep_alive_set); the control, a model with a keep-alive, goes."""
    residency = make(
        tiny("kept", tiny_llama, keep_alive_s=0),
        tiny("timed", tiny_llama, keep_alive_s=300),
    )
    for name in ("kept", "timed"):
        async with residency.using(name, keep_alive_s=0):
            pass
    assert residency.keep_alive_set("kept", 0.0)
    await residency.expire_idle()
    assert sorted(residency.models) == ["kept"]
    assert not residency.keep_alive_set("timed", 0.0)  # not resident: no-op


async def test_unload_drains_the_leases_then_a_late_request_reloads(make):
    """`unload_drained` waits for the model's leases; a request arriving
    meanwhile waits for the drain, then gets the model loaded afresh."""
    residency = make()
    old = await residency.ensure_loaded("a")
    lease = Lease(residency, "a")
    await lease.taken.wait()
    unload = asyncio.create_task(residency.unload_drained("a"))
    await await_for(lambda: len(suspended_in(unload)) > 1, what="the drain begun")
    late = asyncio.create_task(residency.ensure_loaded("a"))
    await await_for(lambda: len(suspended_in(late)) > 1, what="the request waiting")
    assert residency.models == {"a": old}  # draining: the lease is still held
    assert not unload.done() and not late.done()
    await lease.release()
    await unload
    fresh = await late
    assert fresh is not old and residency.models == {"a": fresh}


async def test_a_request_overdue_during_a_drain_is_overloaded(make):
    """A request waiting for a drain longer than the queue timeout is refused
    as overloaded; the drain goes on."""
    residency = make(queue_timeout_s=0.2)
    lease = Lease(residency, "a")
    await lease.taken.wait()
    unload = asyncio.create_task(residency.unload_drained("a"))
    await await_for(lambda: len(suspended_in(unload)) > 1, what="the drain begun")
    with pytest.raises(ProtocolError) as error:
        await residency.ensure_loaded("a")
    assert error.value.code == "overloaded"
    assert "unloading" in error.value.message
    assert not unload.done()
    await lease.release()
    await unload
    assert residency.models == {}


async def test_unloading_a_model_not_resident_is_unknown(make):
    """Unloading a model that is not resident is unknown_model."""
    residency = make()
    with pytest.raises(ProtocolError) as error:
        await residency.unload_drained("a")
    assert error.value.code == "unknown_model"


async def test_configure_applies_new_limits_to_resident_models(make, tiny_llama):
    """New limits reach the generation model's queue and the decode thread,
    and a model's new batch settings its micro-batcher (the bundled MiniLM)."""
    embedder = ModelSpec.from_dict(embedder_spec(batch_window_ms=5, max_batch_size=8))
    residency = make(tiny("a", tiny_llama), embedder)
    generator = await residency.ensure_loaded("a")
    batched = await residency.ensure_loaded(embedder.name)
    assert (generator.runner.queue_limit, batched.batcher.max_batch_size) == (64, 8)
    residency.config.models[embedder.name] = ModelSpec.from_dict(
        embedder_spec(batch_window_ms=20, max_batch_size=3)
    )
    limits = Limits(queue_limit=5, queue_timeout_s=7, max_parallel_requests=2)
    residency.configure(limits)
    assert generator.runner.queue_limit == 5
    assert generator.runner.queue_timeout_s == 7
    assert residency.decoder.max_parallel == 2
    assert batched.batcher.max_batch_size == 3
    assert batched.batcher.window_s == pytest.approx(0.02)
    assert batched.batcher.queue_timeout_s == 7
