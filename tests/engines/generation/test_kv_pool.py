"""The KV pool a model's slots share, in a real engine: a prefix copied from a
slot in use, a conversation longer than an equal share of the pool, idle
slots' caches dropped for room, and auto slots sized by the memory budget."""

import threading

import pytest

from engines.wire.client import EngineRequestError
from engines.wire.replies import GenerateAnswer, ModelState
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import start_engine
from tests.engines.generating import gguf_spec
from tests.waiting import wait_for

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED, PLAIN = "smol-shared", "smol-plain"
POOLED = "smol-pooled"
BUDGET_MIB = 13
KV_PER_TOKEN = 2 * 30 * 192 * 2  # bytes: 30 layers, 3 KV heads x 64, f16 K and V
POOL = int(BUDGET_MIB * 2**20 / KV_PER_TOKEN)  # 591
AUTO = "smol-auto"
# A system prompt long enough that copying it is worth it (and to see).
SYSTEM = " ".join(
    f"Rule {n}: answer questions about the harbour of Port {n} politely."
    for n in range(1, 13)
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = start_engine(
        tmp_path_factory.mktemp("kv-pool"),
        models=[
            gguf_spec(SHARED, FILE, slots=2),
            gguf_spec(PLAIN, FILE, slots=2, prompt_cache=False),
            # Four slots over a pool of 591 tokens: an equal share is 147.
            gguf_spec(POOLED, FILE, slots=4, context_length=512),
            gguf_spec(AUTO, FILE, context_length=1024),
        ],
        preload=[SHARED, PLAIN],
        # 591 tokens of SmolLM2's KV for each model's pool.
        limits={"kv_cache_mib": BUDGET_MIB, "max_slots_per_model": 6},
    )
    yield engine
    engine.stop()


def resident(engine, name: str) -> ModelState:
    models = engine.client().state().models
    return next(model for model in models if model.name == name)


def ask(engine, model: str, question: str, **fields) -> GenerateAnswer:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    fields = {"temperature": 0, "max_tokens": 8, **fields}
    return engine.client().generate(
        GenerateRequest(model=model, messages=messages, **fields)
    )


def while_busy(engine, model: str, then):
    """Run `then()` while another request of the model, with the same system
    prompt, holds a slot (its first token seen, so its prompt is in the KV)."""
    started, release = threading.Event(), threading.Event()
    outcome = {}

    def long_answer():
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Tell me a long story about ships."},
        ]
        client = engine.client()
        stream = client.generate_stream(
            GenerateRequest(
                model=model,
                messages=messages,
                max_tokens=400,
                ignore_eos=True,
                temperature=0,
            )
        )
        for frame in stream:
            if frame.event == "token":
                started.set()
                break
        release.wait(120)
        stream.close()
        outcome["done"] = True

    worker = threading.Thread(target=long_answer)
    worker.start()
    try:
        assert started.wait(120)
        return then()
    finally:
        release.set()
        worker.join(120)


def test_a_prefix_in_use_is_copied_and_the_answer_does_not_change(engine):
    """A request whose system prompt a running request holds takes it from
    that slot (copied_tokens grows; cached_tokens counts it) instead of
    evaluating it; its greedy answer is the one of a model without any cache,
    which copies nothing (the control)."""
    before = resident(engine, SHARED).copied_tokens
    shared = while_busy(engine, SHARED, lambda: ask(engine, SHARED, "Name a ship."))
    copied = resident(engine, SHARED).copied_tokens - before
    plain = while_busy(engine, PLAIN, lambda: ask(engine, PLAIN, "Name a ship."))
    assert shared.text == plain.text
    assert plain.usage.cached_tokens == 0
    assert resident(engine, PLAIN).copied_tokens == 0
    # The whole system prompt (well over 100 tokens) came from the other slot.
    assert copied > 100
    assert shared.usage.cached_tokens == copied


def test_one_conversation_may_use_more_than_an_equal_share_of_the_pool(engine):
    """Four slots share 591 tokens: a 400-token prompt (well over a quarter)
    is answered; the pool and the plan show in the engine's state."""
    prompt = "Count the boats: " + "boat " * 380
    reply = engine.client().generate(
        GenerateRequest(model=POOLED, prompt=prompt, max_tokens=4)
    )
    assert reply.usage.prompt_tokens > 380
    model = resident(engine, POOLED)
    assert (model.slots, model.kv_pool_tokens, model.context) == (4, POOL, 512)
    assert model.slots_auto is False


def test_idle_caches_are_dropped_when_the_pool_needs_the_room(engine):
    """Two long prompts in a row, each over half the pool: the second needs
    the room the first one's cache holds, which is dropped (the first prompt
    again is evaluated anew: nothing of it comes from the cache). Control:
    with the room there, a repeated prompt comes from the cache."""
    client = engine.client()
    first = "Count the boats: " + "boat " * 330
    second = "Count the cats: " + "cat " * 330
    client.generate(GenerateRequest(model=POOLED, prompt=first, max_tokens=2))
    again = client.generate(GenerateRequest(model=POOLED, prompt=first, max_tokens=2))
    assert again.usage.cached_tokens > 300  # the control: it was kept
    client.generate(GenerateRequest(model=POOLED, prompt=second, max_tokens=2))
    after = client.generate(GenerateRequest(model=POOLED, prompt=first, max_tokens=2))
    assert after.usage.cached_tokens < 10


def test_auto_slots_follow_the_memory_budget_up_to_the_cap(engine):
    """Auto slots: one per 1,024 tokens of the pool (a context, if shorter): a
    591-token budget with a 1,024-token context gives one slot, whose pool is
    then the whole context."""
    engine.client().generate(GenerateRequest(model=AUTO, prompt="Hello", max_tokens=1))
    model = resident(engine, AUTO)
    assert model.slots_auto is True
    assert model.slots == 1
    assert model.kv_pool_tokens == 1024
    assert model.kv_mib == pytest.approx(1024 * KV_PER_TOKEN / 2**20, abs=0.1)


def test_a_prompt_over_the_context_is_refused_with_the_counts(engine):
    with pytest.raises(EngineRequestError) as error:
        engine.client().generate(
            GenerateRequest(model=POOLED, prompt="boat " * 600, max_tokens=4)
        )
    assert error.value.code == "context_length_exceeded"
    assert "context holds 512" in error.value.message


def test_a_full_pool_fails_the_newest_request_and_the_others_go_on(engine):
    """Three long prompts at once on a pool that holds two of them with their
    answers: the newest request fails with `overloaded` (retry later) and
    frees its room; the two before it finish whole."""
    # About 213 tokens; with 60 of answer, two fit in the 591-token pool.
    prompt = "Count the waves: " + "wave " * 200
    outcomes: dict[int, object] = {}

    def run(index: int) -> None:
        try:
            outcomes[index] = engine.client().generate(
                GenerateRequest(
                    model=POOLED,
                    prompt=prompt + f" ({index})",
                    max_tokens=60,
                    ignore_eos=True,
                )
            )
        except EngineRequestError as error:
            outcomes[index] = error

    first = threading.Thread(target=run, args=(0,))
    first.start()
    wait_for(lambda: resident(engine, POOLED).busy >= 1, what="a slot busy")
    others = [threading.Thread(target=run, args=(n,)) for n in (1, 2)]
    for worker in others:
        worker.start()
    for worker in [first, *others]:
        worker.join(120)
    failed = [n for n, o in outcomes.items() if isinstance(o, EngineRequestError)]
    answered = [n for n, o in outcomes.items() if isinstance(o, GenerateAnswer)]
    assert len(failed) == 1 and 0 in answered
    assert outcomes[failed[0]].code == "overloaded"
    assert "KV pool" in outcomes[failed[0]].message
    for n in answered:
        assert outcomes[n].usage.completion_tokens == 60
