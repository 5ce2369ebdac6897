"""Generation through the transformers backend in a real engine: a tiny Llama
built by the test, and SmolLM2 loaded from its GGUF by transformers."""

import asyncio
from pathlib import Path

import pytest
from django.conf import settings

from engines.wire.client import EngineRequestError
from engines.wire.requests import GenerateRequest, TokenizeRequest
from tests.engines.conftest import start_engine
from tests.engines.generating import (
    chat,
    generated_logprobs,
    model_state,
    wait_idle,
)

TINY = "tiny-llama"
SMOL_HF = "smollm2-via-transformers"


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory, tiny_llama):
    engine = start_engine(
        tmp_path_factory.mktemp("hf"),
        models=[
            {
                "name": TINY,
                "format": "transformers",
                "path": str(tiny_llama),
                "context_length": 256,
                "slots": 4,
            },
            {
                "name": SMOL_HF,
                "format": "transformers",
                "path": str(
                    Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"
                ),
                "context_length": 256,
                "slots": 2,
            },
        ],
        preload=[TINY],
    )
    yield engine
    engine.stop()


def test_stream_usage_and_max_tokens(hf_engine):
    """Text streams in frames whose token counts add up to the usage; max_tokens
    ends with `length`; the stream equals the whole answer."""
    client = hf_engine.client()
    fields = {
        "prompt": "the cat",
        "temperature": 0,
        "max_tokens": 10,
        "ignore_eos": True,
    }
    frames = list(client.generate_stream(GenerateRequest(model=TINY, **fields)))
    done = frames[-1]
    tokens = [f for f in frames if f.event == "token"]
    assert frames[0].event == "start"
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 10
    assert sum(f.tokens for f in tokens) == 10
    assert len(tokens) >= 2
    whole = client.generate(GenerateRequest(model=TINY, **fields))
    assert whole.text == "".join(f.text for f in tokens)


def test_stop_string(hf_engine):
    """A stop string ends the text just before it, with finish reason `stop`."""
    client = hf_engine.client()
    fields = {"prompt": "hello", "temperature": 0, "max_tokens": 30, "ignore_eos": True}
    full = client.generate(GenerateRequest(model=TINY, **fields)).text
    assert len(full) > 12
    stop = full[8:11]
    stopped = client.generate(GenerateRequest(model=TINY, **fields, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]


def test_chat_uses_the_tokenizer_template(hf_engine, tiny_llama):
    """A chat request is formatted with the tokenizer's own chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = tokenizer("user: hi\nassistant:").input_ids
    reply = hf_engine.client().generate(
        GenerateRequest(
            model=TINY,
            messages=chat("hi"),
            temperature=0,
            max_tokens=3,
            ignore_eos=True,
        )
    )
    assert reply.usage.prompt_tokens == len(expected)


def test_no_cross_talk_between_rows(hf_engine):
    """4 concurrent greedy streams (one batched forward per step, left-padded
    KV) agree with each run alone: same tokens, log-probs within 1e-3."""
    prompts = ["the cat", "a dog ran in", "ships", "hello world, how"]
    fields = {
        "temperature": 0,
        "max_tokens": 16,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }

    def run(prompt):
        return generated_logprobs(
            hf_engine.client().generate_stream(
                GenerateRequest(model=TINY, prompt=prompt, **fields)
            )
        )

    alone = [run(p) for p in prompts]

    async def together():
        client = hf_engine.aclient()

        async def one(prompt):
            stream = client.generate_stream(
                GenerateRequest(model=TINY, prompt=prompt, **fields)
            )
            return [frame async for frame in stream]

        return await asyncio.gather(*(one(p) for p in prompts))

    concurrent = [generated_logprobs(f) for f in asyncio.run(together())]
    for solo, batched in zip(alone, concurrent, strict=True):
        assert [e.token for e in solo] == [e.token for e in batched]
        for a, b in zip(solo, batched, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3


def test_seeded_sampling_is_reproducible(hf_engine):
    """The same seed gives the same sample, alone or beside other requests."""
    client = hf_engine.client()
    fields = {"prompt": "a dog", "temperature": 1.0, "seed": 7, "max_tokens": 12}
    request = GenerateRequest(model=TINY, **fields, ignore_eos=True)
    first = client.generate(request).text
    assert client.generate(request).text == first


def test_cancel_and_disconnect_free_the_slot(hf_engine):
    """Cancel by id ends the stream with `cancelled`; hanging up frees the slot."""
    client = hf_engine.client()
    stream = client.generate_stream(
        GenerateRequest(model=TINY, prompt="ships", max_tokens=200, ignore_eos=True)
    )
    start = next(stream)
    next(stream)
    assert hf_engine.client().cancel(start.request_id) is True
    assert list(stream)[-1].finish_reason == "cancelled"
    wait_idle(hf_engine, TINY)

    stream = client.generate_stream(
        GenerateRequest(model=TINY, prompt="ships", max_tokens=200, ignore_eos=True)
    )
    next(stream), next(stream)
    assert model_state(hf_engine, TINY).busy == 1
    stream.close()
    wait_idle(hf_engine, TINY)


def test_smollm2_from_its_gguf(hf_engine):
    """transformers loads (dequantizes) the bundled GGUF and answers a chat."""
    reply = hf_engine.client().generate(
        GenerateRequest(
            model=SMOL_HF,
            messages=chat("What is the capital of France?"),
            temperature=0,
            max_tokens=12,
        )
    )
    assert reply.usage.completion_tokens >= 1
    assert "Paris" in reply.text
    with pytest.raises(EngineRequestError) as error:
        hf_engine.client().generate(GenerateRequest(model=SMOL_HF, prompt="x", top_p=2))
    assert error.value.code == "bad_request"


def test_tokenize_counts_what_a_generation_evaluates(hf_engine):
    """On the transformers backend, `tokenize` of a chat counts the prompt
    tokens a generation of it reports, and detokenize gives a text prompt
    back (the control: another chat counts differently)."""
    client = hf_engine.client()
    messages = chat("the dog ran in the park")
    counted = client.tokenize(TokenizeRequest(model=TINY, messages=messages))
    answer = client.generate(
        GenerateRequest(model=TINY, messages=messages, max_tokens=2, temperature=0)
    )
    assert counted.count == answer.usage.prompt_tokens == len(counted.tokens)
    other = client.tokenize(TokenizeRequest(model=TINY, messages=chat("hello")))
    assert other.count != counted.count
    text = "the cat sat on the mat"
    tokens = client.tokenize(TokenizeRequest(model=TINY, prompt=text)).tokens
    assert client.detokenize(TINY, tokens).text == text
