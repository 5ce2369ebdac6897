"""A failing request fails alone, in a real engine: a model with a poisoned
token (its embedding row is NaN, so any prompt holding it yields NaN logits)
beside clean streams on the same model; and the engine answers `state` while a
model loads, and reports a decode loop that stops making passes."""

import asyncio
import threading
from pathlib import Path

import pytest

from engines.wire.client import EngineRequestError
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import build_tiny_llama, start_engine
from tests.engines.generating import gguf_spec, transformers_spec, wait_idle
from tests.waiting import wait_for

POISONED = "poisoned-llama"
CLEAN = "clean-llama"
POISON_PROMPT = "dog dog dog"
CLEAN_PROMPT = "the cat sat on the mat"


def _poison(folder: Path) -> None:
    """Set the embedding rows of the tokens of POISON_PROMPT to NaN, checking
    that CLEAN_PROMPT shares none of them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    poison = set(tokenizer(POISON_PROMPT, add_special_tokens=False)["input_ids"])
    clean = set(tokenizer(CLEAN_PROMPT)["input_ids"])
    assert poison and not poison & clean
    with torch.no_grad():
        for token in poison:
            model.model.embed_tokens.weight[token] = float("nan")
    model.save_pretrained(folder)


def completion_tokens(engine, model: str, prompt: str, **fields) -> int:
    """How many tokens one request to `model` on `engine` generated."""
    reply = engine.client().generate(
        GenerateRequest(model=model, prompt=prompt, **fields)
    )
    return reply.usage.completion_tokens


@pytest.fixture(scope="module")
def fault_engine(tmp_path_factory, tiny_llama):
    poisoned = build_tiny_llama(tmp_path_factory.mktemp("poisoned"))
    _poison(poisoned)
    engine = start_engine(
        tmp_path_factory.mktemp("faults"),
        models=[
            transformers_spec(POISONED, poisoned),
            transformers_spec(CLEAN, tiny_llama),
        ],
        preload=[POISONED, CLEAN],
    )
    yield engine
    engine.stop()


def test_a_failing_request_fails_alone(fault_engine):
    """Two streams run on the poisoned model while a request holding a poisoned
    token fails with `internal`: the streams finish whole, the model and the
    other model go on serving, and the engine stays healthy."""
    stream_fields = {
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 40,
        "ignore_eos": True,
    }

    async def scenario():
        client = fault_engine.aclient()
        first_tokens = asyncio.Event()
        seen = 0

        async def clean_stream():
            nonlocal seen
            frames = []
            async for frame in client.generate_stream(
                GenerateRequest(model=POISONED, prompt=CLEAN_PROMPT, **stream_fields)
            ):
                frames.append(frame)
                if frame.event == "token" and len(frames) == 2:
                    seen += 1
                    if seen == 2:
                        first_tokens.set()
            return frames

        async def poisoned_request():
            await first_tokens.wait()  # both streams are mid-generation
            with pytest.raises(EngineRequestError) as error:
                await client.generate(
                    GenerateRequest(
                        model=POISONED,
                        prompt=POISON_PROMPT,
                        temperature=1.0,
                        max_tokens=5,
                    )
                )
            return error.value

        return await asyncio.gather(clean_stream(), clean_stream(), poisoned_request())

    first, second, failure = asyncio.run(scenario())
    assert failure.code == "internal"
    assert "non-finite" in str(failure)
    for frames in (first, second):
        assert frames[-1].finish_reason == "length"
        assert frames[-1].usage.completion_tokens == 40
    again = completion_tokens(
        fault_engine, POISONED, CLEAN_PROMPT, temperature=0, max_tokens=4
    )
    assert again >= 1
    state = fault_engine.client().state()
    assert state.healthy is True and state.unhealthy_reason == ""
    wait_idle(fault_engine, POISONED)


def test_the_same_prompt_passes_on_the_clean_model(fault_engine):
    """Control: the poisoned prompt itself is fine; only the poisoned weights
    make it fail."""
    generated = completion_tokens(
        fault_engine,
        CLEAN,
        POISON_PROMPT,
        temperature=1.0,
        max_tokens=5,
        ignore_eos=True,
    )
    assert generated == 5


def test_greedy_requests_fail_alone_too(fault_engine):
    """Greedy decoding would take the NaN's argmax silently; it fails as well."""
    with pytest.raises(EngineRequestError) as error:
        completion_tokens(
            fault_engine, POISONED, POISON_PROMPT, temperature=0, max_tokens=5
        )
    assert error.value.code == "internal"
    generated = completion_tokens(
        fault_engine,
        POISONED,
        CLEAN_PROMPT,
        temperature=0,
        max_tokens=3,
        ignore_eos=True,
    )
    assert generated == 3


def test_state_is_answered_while_a_model_loads(tmp_path):
    """Loading Gemma 3 (a 262k-token vocabulary) runs off the event loop: the
    engine answers `state` with phase `loading` meanwhile, then `ready`."""
    gemma = gguf_spec("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", task="completion")
    engine = start_engine(tmp_path, models=[gemma])
    try:
        loaded = threading.Event()

        def load():
            engine.client().call("load", model=gemma["name"])
            loaded.set()

        thread = threading.Thread(target=load, daemon=True)
        phases = []
        thread.start()

        def loaded_now() -> bool:
            state = engine.client().state()  # a control frame: times out in seconds
            phases.append(state.phase)
            if state.phase == "loading":
                assert state.loading == [gemma["name"]]
            return loaded.is_set()

        wait_for(loaded_now, timeout=120, interval=0, what="the load")
        thread.join(5)
        assert loaded.is_set(), engine.log()
        assert "loading" in phases
        assert engine.client().state().phase == "ready"
    finally:
        engine.stop()


def test_a_decode_loop_without_passes_is_reported_unhealthy(tmp_path):
    """With a stuck limit shorter than one pass over a long prompt, `state`
    says unhealthy, naming the stuck loop, while the pass runs; healthy again
    once it is done. (The real limit is a minute; a pass takes milliseconds.)"""
    smol = gguf_spec(
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        context_length=2048,
        slots=1,
    )
    engine = start_engine(
        tmp_path,
        models=[smol],
        preload=[smol["name"]],
        limits={"stuck_after_s": 0.05},
    )
    try:
        assert engine.client().state().healthy is True  # control: idle is healthy
        done = threading.Event()
        prompt = "The harbour master counted the ships again. " * 150

        def run():
            engine.client().generate(
                GenerateRequest(model=smol["name"], prompt=prompt, max_tokens=4)
            )
            done.set()

        threading.Thread(target=run, daemon=True).start()
        reasons = set()
        while not done.is_set():
            state = engine.client().state()
            if not state.healthy:
                reasons.add(state.unhealthy_reason.split(":")[0])
        assert reasons == {"the decode loop is stuck"}
        assert engine.client().state().healthy is True
    finally:
        engine.stop()
