"""Every slot is leased and returned exactly once, whatever mix of completions,
cancels and failures arrives: checked with hypothesis on the real transformers
backend (the tiny Llama) and the real runner and decode thread."""

import queue
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.generation.runner import (
    DecodeThread,
    GenerationRequest,
    GenerationRunner,
)
from engines.generation.sampling import SamplingParams
from engines.wire.errors import ProtocolError
from tests.waiting import wait_for

actions = st.lists(
    st.one_of(
        st.tuples(st.just("generate"), st.integers(1, 12)),
        st.tuples(st.just("cancel"), st.integers(0, 20)),
        st.tuples(st.just("too_long"), st.just(0)),  # fails at admission
    ),
    min_size=1,
    max_size=20,
)


@pytest.fixture(scope="module")
def runner(tiny_llama):
    from engines.backends.hf import TransformersBackend

    backend = TransformersBackend(tiny_llama, n_slots=3, context_length=64)
    runner = GenerationRunner(
        backend,
        name="tiny",
        queue_limit=8,
        queue_timeout_s=30,
        decoder=DecodeThread(max_parallel=3),
    )
    yield runner
    runner.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(actions)
def test_random_mix_leaves_no_lease_behind(runner, steps):
    """After any sequence, every request got exactly one final event and the
    model has no busy slot and nothing queued."""
    backend = runner.backend
    submitted: list[tuple[GenerationRequest, queue.Queue]] = []
    for kind, value in steps:
        if kind == "cancel":
            if submitted:
                runner.cancel(submitted[value % len(submitted)][0].id)
            continue
        tokens = backend.tokenize("the cat sat")
        if kind == "too_long":
            tokens = tokens * 40  # longer than the 64-token context
        events: queue.Queue = queue.Queue()
        request = GenerationRequest(
            prompt_tokens=tokens,
            params=SamplingParams(max_tokens=value or 1, ignore_eos=True),
            emit=events.put,
        )
        try:
            runner.submit(request)
        except ProtocolError as error:
            assert error.code == "overloaded"  # queue full: refused, never leased
            continue
        submitted.append((request, events))
    for _request, events in submitted:
        finals = []
        deadline = time.monotonic() + 30
        while not finals:
            event = events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if event["event"] not in ("admitted", "token"):
                finals.append(event)
        assert finals[0]["event"] in ("done", "error")
    wait_for(
        lambda: not (backend.active() or runner.queued),
        timeout=10,
        interval=0.01,
        what="every slot and queue entry given back",
    )
    for request, events in submitted:
        assert request.finished
        assert events.empty()  # nothing arrived after the final event
