"""Prompt caching in a real engine, both backends: the same SmolLM2 file served
twice by llama.cpp and twice by transformers, each once with the cache and once
without (`prompt_cache: false`), so that the answers can be compared."""

from pathlib import Path

import pytest
from django.conf import settings

from engines.wire.requests import GenerateRequest
from tests.engines.conftest import start_engine
from tests.engines.generating import gguf_spec

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHED, UNCACHED = "smol-cached", "smol-uncached"
HF_CACHED, HF_UNCACHED = "smol-hf-cached", "smol-hf-uncached"
SYSTEM = (
    "You are a terse assistant for harbour masters. Answer in a few words. "
    "Mention tides, ships, moorings and weather only when asked about them."
)
QUESTIONS = ["Name a colour.", "Name another one.", "And a third?"]


def hf_spec(name: str, **overrides) -> dict:
    return {
        "name": name,
        "format": "transformers",
        "task": "chat",
        "path": str(Path(settings.MODELS_DIR) / FILE),
        "context_length": 512,
        "slots": 2,
        **overrides,
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = start_engine(
        tmp_path_factory.mktemp("prompt-cache"),
        models=[
            gguf_spec(CACHED, FILE, slots=2),
            gguf_spec(UNCACHED, FILE, slots=2, prompt_cache=False),
            hf_spec(HF_CACHED),
            hf_spec(HF_UNCACHED, prompt_cache=False),
        ],
        preload=[CACHED, UNCACHED],
    )
    yield engine
    engine.stop()


def conversation(engine, model: str) -> list[dict]:
    """Three greedy turns, each resending the whole conversation; the replies."""
    client = engine.client()
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        reply = client.generate(
            GenerateRequest(model=model, messages=messages, temperature=0, max_tokens=8)
        )
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.text})
    return replies


@pytest.mark.parametrize(
    ("cached", "uncached"), [(CACHED, UNCACHED), (HF_CACHED, HF_UNCACHED)]
)
def test_later_turns_come_from_the_cache_and_answers_do_not_change(
    engine, cached, uncached
):
    """Each turn after the first takes the conversation so far from the cache
    (at least the previous turn's whole prompt), and evaluates only the rest;
    the greedy answers are the same as without the cache, where nothing is
    ever taken from it (the control)."""
    with_cache = conversation(engine, cached)
    without = conversation(engine, uncached)
    assert [r.text for r in with_cache] == [r.text for r in without]
    assert [r.usage.prompt_tokens for r in with_cache] == [
        r.usage.prompt_tokens for r in without
    ]
    assert [r.usage.cached_tokens for r in without] == [0, 0, 0]
    assert with_cache[0].usage.cached_tokens == 0
    for before, after in zip(with_cache, with_cache[1:], strict=False):
        cached_tokens = after.usage.cached_tokens
        assert before.usage.prompt_tokens <= cached_tokens
        assert cached_tokens < after.usage.prompt_tokens


def test_a_request_goes_to_the_slot_with_the_longest_shared_prefix(engine):
    """Two slots, one holding a conversation about boats, the other (used
    longer ago: the one least recently used) about cats. The boats prompt
    again goes to its own slot, not the least recently used one: all of it
    but its last token comes from the cache."""
    client = engine.client()

    def ask(topic: str) -> dict:
        messages = [{"role": "user", "content": f"Tell me about {topic}, briefly."}]
        return client.generate(
            GenerateRequest(
                model=CACHED, messages=messages, temperature=0, max_tokens=1
            )
        )

    ask("cats and their whiskers")
    boats = ask("boats and their sails")
    again = ask("boats and their sails")
    assert again.usage.cached_tokens == boats.usage.prompt_tokens - 1


def test_a_cached_prefix_is_reused_only_for_the_same_cache_salt(engine):
    """A prompt read under one cache salt (one caller's, as the front sends
    it) is not taken from the cache for a request with another salt, which
    would tell that caller what the first sent: it is read whole. The same
    salt again takes it from the cache; so do two requests without a salt
    (the control: a model that shares its cache across callers)."""
    client = engine.client()
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which knots hold a mooring line best?"},
    ]

    def ask(salt: str | None) -> int:
        reply = client.generate(
            GenerateRequest(
                model=CACHED,
                messages=messages,
                temperature=0,
                max_tokens=1,
                cache_salt=salt,
            )
        )
        return reply.usage.cached_tokens

    assert ask("owner-a") == 0
    assert ask("owner-b") == 0  # another caller: nothing from a's cache
    assert ask("owner-a") > 32  # a again: its own cache
    assert ask(None) == 0  # no salt is a scope of its own
    assert ask(None) > 32
