"""Residency in a real engine: LRU eviction under models-max, busy models never
evicted, waiting for room, never-fits, keep-alive. Three names for the tiny Llama
the test builds, so loads are fast and real."""

import threading
from pathlib import Path

import pytest
from django.conf import settings

from engines.wire.client import EngineRequestError
from engines.wire.replies import ModelState
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import start_engine
from tests.waiting import wait_for


def tiny(name: str, path, **extra) -> dict:
    return {
        "name": name,
        "format": "transformers",
        "path": str(path),
        "context_length": 256,
        "slots": 1,
        **extra,
    }


@pytest.fixture
def engine(tmp_path, tiny_llama):
    engine = start_engine(
        tmp_path,
        models=[
            tiny("a", tiny_llama),
            # b's memory is known, as after an earlier load: its load decides
            # at once, with no estimate read off the event loop, so once the
            # engine's state shows it loading, it has decided what to evict.
            tiny("b", tiny_llama, measured_mib=64),
            tiny("c", tiny_llama),
            tiny("short-lived", tiny_llama, keep_alive_s=1),
            {  # slow enough to still be busy while the test looks
                "name": "slow",
                "format": "gguf",
                "path": str(
                    Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"
                ),
                "context_length": 512,
                "slots": 1,
            },
        ],
    )
    yield engine
    engine.stop()


def resident(engine) -> list[str]:
    return sorted(m.name for m in engine.client().state().models)


def use(engine, name: str) -> None:
    engine.client().generate(
        GenerateRequest(model=name, prompt="the cat", max_tokens=1)
    )


def loading(engine) -> list[str]:
    return engine.client().state().loading


def model_state(engine, name: str) -> ModelState:
    models = {m.name: m for m in engine.client().state().models}
    return models.get(name, {"queued": 0})


def refusal(engine, name: str) -> EngineRequestError | None:
    """The error a short request for `name` gets (None: it was answered)."""
    try:
        engine.client().generate(GenerateRequest(model=name, prompt="hi", max_tokens=2))
    except EngineRequestError as error:
        return error
    return None


def test_models_max_evicts_the_least_recently_used(engine, engine_limits):
    """With room for two, loading a third evicts the one used longest ago."""
    engine_limits(engine, models_max=2)
    use(engine, "a")
    use(engine, "b")
    use(engine, "a")  # b is now the least recently used
    use(engine, "c")
    assert resident(engine) == ["a", "c"]


def test_a_busy_model_is_never_evicted_the_load_waits(engine, engine_limits):
    """models-max 1 and `slow` streaming: a request for `b` waits until `slow`
    is done, then `slow` is evicted and `b` answers."""
    engine_limits(engine, models_max=1, queue_timeout_s=60)
    stream = engine.client().generate_stream(
        GenerateRequest(model="slow", prompt="ships", max_tokens=60, ignore_eos=True)
    )
    next(stream), next(stream)
    outcome = {}

    def ask_b():
        outcome["reply"] = engine.client().generate(
            GenerateRequest(model="b", prompt="hi", max_tokens=2, ignore_eos=True)
        )

    waiter = threading.Thread(target=ask_b)
    waiter.start()
    wait_for(lambda: loading(engine) == ["b"], what="b loading")  # it has decided
    assert resident(engine) == ["slow"]  # busy: not evicted
    assert "reply" not in outcome
    frames = list(stream)
    assert frames[-1].finish_reason == "length"  # finished undisturbed
    waiter.join(60)
    assert outcome["reply"].usage.completion_tokens >= 1
    assert resident(engine) == ["b"]


def test_waiting_for_room_is_bounded_by_the_queue_timeout(engine, engine_limits):
    """If the busy model stays busy past the queue timeout, the load fails."""
    engine_limits(engine, models_max=1, queue_timeout_s=0.5)
    stream = engine.client().generate_stream(
        GenerateRequest(model="slow", prompt="ships", max_tokens=300, ignore_eos=True)
    )
    next(stream), next(stream)
    with pytest.raises(EngineRequestError) as error:
        engine.client().generate(GenerateRequest(model="b", prompt="hi", max_tokens=2))
    assert error.value.code == "insufficient_memory"
    assert "stayed busy" in error.value.message
    stream.close()


def test_a_model_that_can_never_fit_fails_at_once(engine, engine_limits):
    """A margin larger than the machine: `insufficient_memory` names the shortfall."""
    engine_limits(engine, memory_margin_mib=10**7)
    with pytest.raises(EngineRequestError) as error:
        use(engine, "a")
    assert error.value.code == "insufficient_memory"
    assert "short by" in error.value.message
    assert resident(engine) == []


def test_keep_alive_unloads_an_idle_model(engine):
    """A model idle past its keep-alive is unloaded; others stay."""
    use(engine, "a")
    use(engine, "short-lived")
    wait_for(lambda: "short-lived" not in resident(engine), what="the expiry")
    assert resident(engine) == ["a"]


def test_unload_drains_in_flight_and_queued_work(engine, engine_limits):
    """`unload` lets the request in flight and the one queued behind it (one
    slot) finish; a request arriving during the drain waits, then gets a freshly
    loaded model."""
    engine_limits(engine, queue_limit=1)  # one request may wait behind the stream
    stream = engine.client().generate_stream(
        GenerateRequest(model="slow", prompt="ships", max_tokens=60, ignore_eos=True)
    )
    next(stream), next(stream)
    outcome = {}

    def run(key, call):
        return threading.Thread(target=lambda: outcome.setdefault(key, call()))

    queued = run(
        "queued",
        lambda: engine.client().generate(
            GenerateRequest(model="slow", prompt="sea", max_tokens=3)
        ),
    )
    queued.start()
    wait_for(lambda: model_state(engine, "slow").queued == 1, what="queued")
    unloader = run("unload", lambda: engine.client().call("unload", model="slow"))
    unloader.start()

    def late_reply():
        """Before the drain begins, the queue is full: refused at once. Once it
        has begun, the request waits for it, then for a fresh load."""
        try:
            return engine.client().generate(
                GenerateRequest(
                    model="slow", prompt="hi", max_tokens=2, ignore_eos=True
                )
            )
        except EngineRequestError as error:
            assert "already wait" in error.message, error
            return None

    late = run("late", lambda: wait_for(late_reply, what="the drain to begin"))
    late.start()
    frames = list(stream)
    assert frames[-1].finish_reason == "length"  # not cut off by the unload
    for thread in (queued, unloader, late):
        thread.join(60)
    assert outcome["queued"].finish_reason == "length"  # ran, not cancelled
    assert outcome["queued"].usage.completion_tokens == 3
    assert outcome["unload"].status == "ok"
    assert outcome["late"].usage.completion_tokens >= 1
    assert resident(engine) == ["slow"]  # loaded again for the late request


def test_overdue_work_is_refused_while_an_unload_drains(engine, engine_limits):
    """A request waiting behind a drain gets `overloaded` at its queue timeout,
    though the drain itself goes on."""
    stream = engine.client().generate_stream(
        GenerateRequest(model="slow", prompt="ships", max_tokens=400, ignore_eos=True)
    )
    next(stream), next(stream)
    engine_limits(engine, queue_timeout_s=0.5)
    unloader = threading.Thread(
        target=lambda: engine.client().call("unload", model="slow")
    )
    unloader.start()
    wait_for(lambda: engine.client().state().unloading == ["slow"], what="the drain")
    error = refusal(engine, "slow")  # sent once the drain has begun
    assert error is not None and error.code == "overloaded", error
    assert "drain" in error.message
    assert resident(engine) == ["slow"]  # still draining: the stream runs on
    frames = list(stream)
    assert frames[-1].finish_reason == "length"
    unloader.join(60)
    assert resident(engine) == []
    assert engine.client().state().unloading == []


def test_a_queued_model_is_never_evicted(engine, engine_limits):
    """With one parallel request engine-wide, `a`'s request waits in its queue
    while `slow` streams. Loading `b` under models-max 2 then evicts neither: it
    waits, and once `slow` is done, `a` answers and `b` loads."""
    use(engine, "a")
    engine_limits(engine, models_max=2, max_parallel_requests=1, queue_timeout_s=120)
    stream = engine.client().generate_stream(
        GenerateRequest(model="slow", prompt="ships", max_tokens=300, ignore_eos=True)
    )
    next(stream), next(stream)
    outcome = {}

    def run(key, call):
        thread = threading.Thread(target=lambda: outcome.setdefault(key, call()))
        thread.start()
        return thread

    waiting = run(
        "a",
        lambda: engine.client().generate(
            GenerateRequest(model="a", prompt="the cat", max_tokens=2, ignore_eos=True)
        ),
    )
    wait_for(lambda: model_state(engine, "a").queued == 1, what="a queued")
    loads = run("b", lambda: use(engine, "b") or "ok")
    wait_for(lambda: loading(engine) == ["b"], what="b loading")  # it has decided
    assert resident(engine) == ["a", "slow"]
    assert model_state(engine, "a").queued == 1
    stream.close()
    waiting.join(60), loads.join(60)
    assert outcome["a"].usage.completion_tokens >= 1
    assert outcome["b"] == "ok"
    assert resident(engine) == ["a", "b"]
