"""The decode thread in-process, with a counting backend that can be told to
raise or to block: how a failure in one model's admission or step stays with
its requests, how a loop that dies or stops making passes is reported, and how
closing a model stays bounded. (The same paths with real models are in
runtime/test_resilience.py; this backend lets a test choose exactly where it fails.)"""

import queue
import time

import pytest

from engines.generation.runner import (
    DecodeThread,
    GenerationRequest,
    GenerationRunner,
)
from engines.generation.sampling import SamplingParams
from engines.wire.errors import ProtocolError
from tests.engines.counting_backend import CountingBackend
from tests.waiting import wait_for


class Caller:
    """A request and the events it receives."""

    def __init__(self, runner: GenerationRunner, max_tokens: int = 5) -> None:
        self.events: queue.Queue = queue.Queue()
        self.request = GenerationRequest(
            prompt_tokens=[1, 2],
            params=SamplingParams(max_tokens=max_tokens),
            emit=self.events.put,
        )
        runner.submit(self.request)

    def final(self, timeout: float = 10) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            event = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if event["event"] not in ("admitted", "token"):
                return event


def make(backend=None, **decoder):
    backend = backend or CountingBackend()
    decoder = DecodeThread(max_parallel=8, **decoder)
    runner = GenerationRunner(
        backend, name="m", queue_limit=16, queue_timeout_s=30, decoder=decoder
    )
    return backend, decoder, runner


def test_an_admission_that_raises_fails_only_that_request():
    backend, decoder, runner = make()
    backend.raise_on_admit = RuntimeError("Overflow when unpacking long")
    event = Caller(runner).final()
    assert event["code"] == "internal" and "Overflow" in event["message"]
    ok = Caller(runner)
    assert ok.final()["finish_reason"] == "length"
    assert decoder.alive


def test_an_admission_refusing_the_input_answers_bad_request():
    backend, decoder, runner = make()
    backend.raise_on_admit = ProtocolError("bad_request", "seed out of range")
    event = Caller(runner).final()
    assert (event["code"], event["message"]) == ("bad_request", "seed out of range")
    assert Caller(runner).final()["finish_reason"] == "length"


def test_a_step_that_raises_ends_its_requests_and_the_model_serves_on():
    backend, decoder, runner = make()
    backend.block.clear()  # hold the first step until both requests are in
    first, second = Caller(runner, 50), Caller(runner, 50)
    backend.raise_on_step = RuntimeError("CUDA error: an illegal memory access")
    backend.block.set()
    for caller in (first, second):
        event = caller.final()
        assert event["code"] == "internal" and "illegal memory" in event["message"]
    assert Caller(runner).final()["finish_reason"] == "length"
    assert decoder.alive and backend.active() == 0


def test_a_loop_that_dies_anyway_fails_its_requests_and_says_why():
    backend, decoder, runner = make()
    backend.block.clear()
    caller = Caller(runner, 50)
    backend.raise_on_step = SystemExit("escaped")  # not an Exception: escapes tick
    backend.block.set()
    assert caller.final()["code"] == "internal"
    assert not decoder.alive and "SystemExit" in decoder.died
    with pytest.raises(ProtocolError) as error:
        Caller(runner)
    assert error.value.code == "internal" and "died" in error.value.message
    assert runner.close(timeout=5) is True and backend.closed  # freed here


def test_a_loop_without_passes_is_stuck_and_close_is_bounded():
    backend, decoder, runner = make()
    assert decoder.stuck_for() == 0.0  # control: idle is never stuck
    backend.block.clear()
    caller = Caller(runner, 3)
    wait_for(lambda: decoder.stuck_for() >= 0.2, timeout=10, what="the loop stuck")
    assert decoder.alive
    assert runner.close(timeout=0.3) is False  # stuck: left as it is
    assert not backend.closed
    backend.block.set()
    assert caller.final()["finish_reason"] == "length"
    wait_for(lambda: decoder.stuck_for() == 0, timeout=10, what="the loop unstuck")


def test_a_models_rate_is_its_tokens_per_second_of_decode_steps():
    """The runner measures the model's speed as the tokens its requests were
    sent over the seconds its decode steps took: two requests of 5 tokens
    count 10 tokens; before any token there is no rate (None, not 0). The
    rate's window forgets steps older than it."""
    backend, decoder, runner = make()
    assert runner.rate.per_s() is None
    first, second = Caller(runner), Caller(runner)
    assert first.final()["finish_reason"] == second.final()["finish_reason"]
    steps = list(runner.rate._steps)
    assert sum(tokens for _, _, tokens in steps) == 10
    seconds = sum(taken for _, taken, _ in steps)
    assert runner.rate.per_s() == pytest.approx(10 / seconds)

    runner.rate.window_s = 0.0
    runner.rate.stepped(0.01)  # a step with no token, after the window
    assert runner.rate.per_s() is None
