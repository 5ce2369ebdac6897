"""A slot: one session of a generation model, the request in it and its state
(what it has read, its cache of evaluated tokens, its grammar and tool calls).
The bookkeeping over a model's slots is engines/generation/slot_pool.py."""

from dataclasses import dataclass, field
from typing import Any

from engines.constrained.toolcalls import ToolCallStream
from engines.generation.runner import GenerationRequest
from engines.generation.sampling import TextStream


@dataclass
class Slot:
    """One session of a model: the request in it and its private state. The
    backend keeps its own per-slot state (KV, sampler) in `state`."""

    index: int
    request: GenerationRequest | None = None
    todo: list[int] = field(default_factory=list)
    n_past: int = 0
    next_token: int | None = None
    generated: int = 0
    unsent_tokens: int = 0
    unsent_logprobs: list = field(default_factory=list)
    stream: TextStream = field(default_factory=TextStream)
    state: Any = None
    # The tokens whose KV the slot holds, by position (its cache; outlives a
    # request), when it last held a request, and how many of the current
    # request's prompt tokens came from the cache.
    tokens: list[int] = field(default_factory=list)
    # The cache salt of the request whose KV `tokens` holds: only a request
    # with the same salt reuses or copies it (engines/generation/prefix_sharing.py).
    salt: str = ""
    used_at: int = 0
    cached: int = 0
    # (slot, its request, tokens): the prefix to copy once that slot has read
    # it; the slot reads nothing of its own prompt until then.
    awaiting: tuple | None = None
    # The last pass it took part in (batch slots beside interactive ones take
    # turns: the one left out longest goes first).
    stepped: int = 0
    # The request's grammar (its matcher) and the tool calls read from its
    # answer, when it has them.
    matcher: Any = None
    calls: ToolCallStream | None = None
    # The prompt's log-probabilities, when asked for: its first token's entry,
    # then one per token as its pass reads it; None once sent.
    prompt_entries: list | None = None
