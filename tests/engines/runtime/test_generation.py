"""Generation in a real engine: the bundled SmolLM2 (chat) and Gemma 3 270M (base
model, completions only) GGUFs through llama.cpp with continuous batching."""

import asyncio
import threading

import pytest

from engines.wire.client import EngineRequestError
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import start_engine
from tests.engines.generating import (
    SMOL,
    chat,
    generated_logprobs,
    gguf_spec,
    model_state,
    wait_idle,
)
from tests.waiting import wait_for

GEMMA = "gemma3-270m"


@pytest.fixture(scope="module")
def llm_engine(tmp_path_factory):
    """One engine with SmolLM2 (8 slots) and Gemma resident."""
    engine = start_engine(
        tmp_path_factory.mktemp("llm"),
        models=[
            gguf_spec(SMOL, "SmolLM2-135M-Instruct.Q4_1.gguf", slots=8),
            gguf_spec(GEMMA, "gemma-3-270m-q4_k_m.gguf", task="completion", slots=2),
            gguf_spec("broken", "all-MiniLM-L6-v2/config.json"),
        ],
        preload=[SMOL, GEMMA],
        limits={"max_parallel_requests": 16},
    )
    yield engine
    engine.stop()


def test_chat_answer_arrives_as_a_stream(llm_engine):
    """A chat answer streams in several frames; the stream matches the whole
    answer, and usage counts every token sent."""
    client = llm_engine.client()
    fields = {
        "messages": chat("Name three colours."),
        "temperature": 0,
        "max_tokens": 40,
    }
    frames = list(client.generate_stream(GenerateRequest(model=SMOL, **fields)))
    assert frames[0].event == "start" and frames[0].request_id
    tokens = [f for f in frames if f.event == "token"]
    done = frames[-1]
    assert done.event == "done" and done.finish_reason in ("stop", "length")
    assert len(tokens) >= 5
    assert sum(f.tokens for f in tokens) == done.usage.completion_tokens
    assert done.usage.prompt_tokens > 10
    # The start frame names the prompt's tokens: a stream cut short still has them.
    assert frames[0].prompt_tokens == done.usage.prompt_tokens
    # The engine's own times: the first token came before the end, both after
    # the request arrived.
    assert 0 < done.timings.first_token_ms <= done.timings.total_ms

    whole = client.generate(GenerateRequest(model=SMOL, **fields))
    assert whole.text == "".join(f.text for f in tokens)
    for count in ("prompt_tokens", "completion_tokens"):
        assert getattr(whole.usage, count) == getattr(done.usage, count)
    # The same prompt again: all of it but its last token came from the cache.
    assert whole.usage.cached_tokens == done.usage.prompt_tokens - 1


def test_max_tokens_and_stop_strings(llm_engine):
    """max_tokens ends with `length`; a stop string ends the text just before it,
    and the answer names it (`stop_sequence`; none where no stop string ended it)."""
    client = llm_engine.client()
    fields = {"messages": chat("Write two sentences about dogs."), "temperature": 0}
    short = client.generate(GenerateRequest(model=SMOL, **fields, max_tokens=5))
    assert short.finish_reason == "length"
    assert short.usage.completion_tokens == 5
    assert short.stop_sequence is None

    full = client.generate(GenerateRequest(model=SMOL, **fields, max_tokens=60)).text
    assert len(full) > 30
    stop = full[15:19]  # a stop string that first appears mid-answer
    stopped = client.generate(
        GenerateRequest(model=SMOL, **fields, max_tokens=60, stop=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    assert stopped.stop_sequence == stop


def test_no_cross_talk_between_slots(llm_engine):
    """8 concurrent greedy requests agree with the same requests run alone.

    Batched float arithmetic is not bit-identical to single-sequence arithmetic
    (different kernels, different summation order), so greedy outputs may drift
    where the two best tokens are nearly tied. Measured here: log-probabilities of
    the chosen tokens differ by at most ~0.2 nats between the two runs, and every
    divergence happened where the top two candidates were within 0.1 nats. The
    test bounds both: a slot reading another slot's KV or sampler state would move
    log-probabilities by whole nats and diverge at confident tokens.
    """
    prompts = [
        "Write a haiku about the sea.",
        "What is the capital of Italy?",
        "Give me a synonym for happy.",
        "Describe a cat in one sentence.",
        "What is two plus five?",
        "Name a famous painter.",
        "Say hello in French.",
        "What colour is the sky?",
    ]
    fields = {"temperature": 0, "max_tokens": 32, "logprobs": True, "top_logprobs": 2}

    def run(prompt: str) -> list[dict]:
        frames = llm_engine.client().generate_stream(
            GenerateRequest(model=SMOL, messages=chat(prompt), **fields)
        )
        return generated_logprobs(frames)

    alone = [run(p) for p in prompts]

    async def together():
        client = llm_engine.aclient()

        async def one(prompt):
            return [
                f
                async for f in client.generate_stream(
                    GenerateRequest(model=SMOL, messages=chat(prompt), **fields)
                )
            ]

        return await asyncio.gather(*(one(p) for p in prompts))

    concurrent = [generated_logprobs(frames) for frames in asyncio.run(together())]
    compared = 0
    for solo, batched in zip(alone, concurrent, strict=True):
        for a, b in zip(solo, batched, strict=False):  # lengths may differ
            if a.token != b.token:
                top = a.top_logprobs
                gap = top[0].logprob - top[1].logprob
                assert gap < 0.5, f"diverged at a confident token (gap {gap:.3f})"
                break
            assert abs(a.logprob - b.logprob) < 0.5
            compared += 1
    assert compared >= 60  # most of the 8 x 32 tokens were compared


def test_cancel_ends_the_stream_and_frees_the_slot(llm_engine):
    """`cancel` by request id ends the stream with `cancelled`; the slot frees."""
    client = llm_engine.client()
    stream = client.generate_stream(
        GenerateRequest(
            model=SMOL, prompt="Once upon a time", max_tokens=400, ignore_eos=True
        )
    )
    start = next(stream)
    next(stream)  # decoding has begun
    assert model_state(llm_engine, SMOL).busy == 1
    assert llm_engine.client().cancel(start.request_id) is True
    rest = list(stream)
    assert rest[-1].event == "done" and rest[-1].finish_reason == "cancelled"
    assert rest[-1].usage.completion_tokens < 400
    wait_idle(llm_engine, SMOL)
    assert llm_engine.client().cancel(start.request_id) is False


def test_disconnect_cancels_and_frees_the_slot(llm_engine):
    """A caller that hangs up mid-stream is cancelled; its slot is free again."""
    stream = llm_engine.client().generate_stream(
        GenerateRequest(
            model=SMOL, prompt="The history of ships", max_tokens=400, ignore_eos=True
        )
    )
    next(stream), next(stream)
    assert model_state(llm_engine, SMOL).busy == 1
    steps = model_state(llm_engine, SMOL).steps
    stream.close()
    wait_idle(llm_engine, SMOL)
    assert model_state(llm_engine, SMOL).steps - steps < 50


def test_base_model_serves_completions_but_refuses_chat(llm_engine):
    """Gemma 3 270M has no chat template: completions work, chat is refused."""
    client = llm_engine.client()
    reply = client.generate(
        GenerateRequest(
            model=GEMMA, prompt="The capital of France is", max_tokens=6, temperature=0
        )
    )
    assert reply.usage.completion_tokens >= 1
    assert reply.text.strip()
    with pytest.raises(EngineRequestError) as error:
        client.generate(GenerateRequest(model=GEMMA, messages=chat("hi")))
    assert error.value.code == "bad_request"
    assert "no chat template" in error.value.message


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be positive"),
        ({"prompt": "x", "top_p": 1.5}, "top_p must be at most 1"),
        ({"prompt": "x", "stop": [""]}, "stop must be"),
        ({"messages": [{"role": "user"}]}, "string role and content"),
        ({"prompt": "x", "messages": chat("y")}, "exactly one of"),
        ({}, "exactly one of"),
    ],
)
def test_bad_generation_requests(llm_engine, fields, needle):
    """Malformed generation requests are `bad_request` naming the problem."""
    with pytest.raises(EngineRequestError) as error:
        llm_engine.client().generate(GenerateRequest(model=SMOL, **fields))
    assert error.value.code == "bad_request"
    assert needle in error.value.message


def test_many_streams_share_the_decode_loop(llm_engine):
    """12 streams on 8 slots all complete; the overflow waits its turn (FIFO)."""
    results: list = [None] * 12

    def run(index: int) -> None:
        frames = list(
            llm_engine.client().generate_stream(
                GenerateRequest(
                    model=SMOL, prompt=f"Story {index}:", max_tokens=16, ignore_eos=True
                )
            )
        )
        results[index] = frames[-1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(r and r.finish_reason == "length" for r in results)
    assert all(r.usage.completion_tokens == 16 for r in results)
    wait_idle(llm_engine, SMOL)


def test_two_models_stream_at_once(llm_engine):
    """Streams on two resident models interleave on the engine's decode thread."""

    async def both():
        client = llm_engine.aclient()

        async def run(model, **fields):
            stream = client.generate_stream(
                GenerateRequest(model=model, max_tokens=12, ignore_eos=True, **fields)
            )
            return [frame async for frame in stream][-1]

        return await asyncio.gather(
            run(SMOL, messages=chat("Tell me a story.")),
            run(GEMMA, prompt="Once upon a time"),
        )

    for done in asyncio.run(both()):
        assert done.finish_reason == "length"
        assert done.usage.completion_tokens == 12


def test_a_model_that_fails_to_load_leaves_the_engine_serving(llm_engine):
    """A file llama.cpp cannot load is an error for that request only."""
    client = llm_engine.client()
    with pytest.raises(EngineRequestError) as error:
        client.generate(GenerateRequest(model="broken", prompt="hello"))
    assert error.value.code == "internal"
    assert "cannot load" in error.value.message
    assert client.generate(GenerateRequest(model=SMOL, prompt="Hi", max_tokens=2))
    assert "broken" not in [m.name for m in client.state().models]


def long_running_stream(client):
    """A SmolLM2 stream already decoding, which keeps its slot for seconds."""
    stream = client.generate_stream(
        GenerateRequest(model=SMOL, prompt="Long", max_tokens=300, ignore_eos=True)
    )
    next(stream), next(stream)
    return stream


def test_admission_is_fifo_under_max_parallel_and_timeout_zero(
    llm_engine, engine_limits
):
    """max_parallel_requests 1: requests run one at a time in arrival order; with
    a queue timeout of 0 a request is refused unless a slot is free right now."""
    client = llm_engine.client()
    engine_limits(llm_engine, max_parallel_requests=1)
    finished: list[int] = []
    try:
        threads = []
        for index in range(4):

            def run(index=index):
                client.generate(
                    GenerateRequest(
                        model=SMOL,
                        prompt=f"Tale {index}",
                        max_tokens=24,
                        ignore_eos=True,
                    )
                )
                finished.append(index)

            threads.append(threading.Thread(target=run))
            threads[-1].start()
            wait_for(
                lambda index=index: (
                    model_state(llm_engine, SMOL).queued
                    + model_state(llm_engine, SMOL).busy
                    >= index + 1 - len(finished)
                ),
                what=f"request {index} queued or running",
            )
            assert model_state(llm_engine, SMOL).busy <= 1
        for thread in threads:
            thread.join(60)
        assert finished == [0, 1, 2, 3]
        # The last answer reaches its caller just before its lease is given
        # back: with a queue timeout of 0 the next request must find it free.
        wait_for(
            lambda: (
                not any(
                    getattr(model_state(llm_engine, SMOL), k)
                    for k in ("inflight", "busy")
                )
            ),
            what="the lease given back",
        )

        engine_limits(llm_engine, queue_timeout_s=0)
        stream = long_running_stream(client)
        with pytest.raises(EngineRequestError) as error:
            client.generate(GenerateRequest(model=SMOL, prompt="Now?", max_tokens=2))
        assert error.value.code == "overloaded"
        assert "queue timeout is 0" in error.value.message
        stream.close()
    finally:
        wait_idle(llm_engine, SMOL)


def test_full_queue_and_queue_timeout_answer_overloaded(llm_engine, engine_limits):
    """One request running (max parallel 1): with a queue of one, a third request
    is refused at once; with a short queue timeout, a waiting one is refused."""
    client = llm_engine.client()
    tight = {"max_parallel_requests": 1, "queue_limit": 1, "queue_timeout_s": 60}
    engine_limits(llm_engine, **tight)
    outcome: dict = {}
    try:
        stream = long_running_stream(client)
        waiter = threading.Thread(
            target=lambda: outcome.setdefault(
                "queued",
                client.generate(
                    GenerateRequest(
                        model=SMOL, prompt="Wait", max_tokens=2, ignore_eos=True
                    )
                ),
            )
        )
        waiter.start()
        wait_for(
            lambda: model_state(llm_engine, SMOL).queued >= 1, what="a request queued"
        )
        with pytest.raises(EngineRequestError) as error:
            client.generate(GenerateRequest(model=SMOL, prompt="Third", max_tokens=2))
        assert error.value.code == "overloaded"
        assert "already wait" in error.value.message
        stream.close()
        waiter.join(60)
        assert outcome["queued"].usage.completion_tokens >= 1

        short = {**tight, "queue_limit": 8, "queue_timeout_s": 0.3}
        engine_limits(llm_engine, **short)
        stream = long_running_stream(client)
        with pytest.raises(EngineRequestError) as error:
            client.generate(GenerateRequest(model=SMOL, prompt="Late", max_tokens=2))
        assert error.value.code == "overloaded"
        assert "waited more than 0.3 s" in error.value.message
        # Refused while the long request still runs, not when its slot freed.
        assert model_state(llm_engine, SMOL).busy == 1
        # A stream refused in the queue gets the error as its first frame, not
        # a start frame (the front has not answered 200 yet: it answers 429).
        frames = client.generate_stream(
            GenerateRequest(model=SMOL, prompt="Late too", max_tokens=2)
        )
        with pytest.raises(EngineRequestError) as error:
            next(frames)
        assert error.value.code == "overloaded"
        stream.close()
    finally:
        wait_idle(llm_engine, SMOL)
