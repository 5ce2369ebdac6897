"""A prompt against the model's context: the tokens of a request, refused with
the counts when they do not fit, or, for a chat whose model allows it, with its
oldest turns dropped until they do.

A model's `context_overflow` setting says which: "refuse" (the default, as
OpenAI's API does: `context_length_exceeded`) or "drop_oldest" (the system
messages and the latest message stay; the oldest of the others go first, until
the prompt leaves room for the answer: its max_tokens, at most a quarter of the
context)."""

from dataclasses import dataclass
from typing import Any

from engines.generation.sampling import SamplingParams
from engines.generation.slot_pool import SlotBackend
from engines.launch.config import CONTEXT_OVERFLOW
from engines.wire.errors import ErrorCode, ProtocolError

REFUSE, DROP_OLDEST = CONTEXT_OVERFLOW
# Leading messages of these roles are instructions: never dropped.
KEPT_ROLES = ("system", "developer")


@dataclass
class Prompt:
    tokens: list[int]
    dropped_messages: int = 0


def fit_prompt(
    backend: SlotBackend,
    message: dict[str, Any],
    params: SamplingParams,
    *,
    policy: str = REFUSE,
    model: str = "",
) -> Prompt:
    """The request's prompt tokens, fitted to the backend's context."""
    context = backend.ctx_per_slot
    tools = None
    if message.get("prompt_tokens") is not None:
        tokens = known_tokens(backend, message["prompt_tokens"], "prompt_tokens")
    else:
        # The tools are made into prompt text once, however many renders.
        tools = backend.offered_tools(message)
        tokens = backend.tokenize(backend.render_prompt(message, tools=tools))
    # At least one token of answer must fit after the prompt.
    if len(tokens) < context - 1 and (
        policy != DROP_OLDEST or len(tokens) + _room(params, context) <= context
    ):
        return Prompt(tokens)
    messages = message.get("messages")
    if policy != DROP_OLDEST or not isinstance(messages, list):
        raise _exceeded(len(tokens), context, model, dropped=0, can_drop=False)
    kept = len(messages) - 1  # the latest message always stays
    first = 0
    while first < kept and _role(messages[first]) in KEPT_ROLES:
        first += 1
    # Where the kept part may start: at a user message (a turn never starts
    # with the answer to a dropped question), or at the latest message.
    cuts = [
        dropped
        for dropped in range(1, kept - first + 1)
        if first + dropped == kept or _role(messages[first + dropped]) == "user"
    ]
    if not cuts:
        raise _exceeded(len(tokens), context, model, dropped=0, can_drop=True)
    counted: dict[int, list[int]] = {}

    def tokens_without(dropped: int) -> list[int]:
        if dropped not in counted:
            trimmed = messages[:first] + messages[first + dropped :]
            rendered = backend.render_prompt(
                {**message, "messages": trimmed}, tools=tools
            )
            counted[dropped] = backend.tokenize(rendered)
        return counted[dropped]

    # The fewest dropped that leave room for the answer: the prompt shrinks as
    # more is dropped, so a binary search (a long chat costs a few renders).
    low, high = 0, len(cuts) - 1
    while low < high:
        middle = (low + high) // 2
        if len(tokens_without(cuts[middle])) + _room(params, context) <= context:
            high = middle
        else:
            low = middle + 1
    dropped = cuts[low]
    tokens = tokens_without(dropped)
    if len(tokens) < context - 1:  # short of room, the answer may end "length"
        return Prompt(tokens, dropped)
    raise _exceeded(len(tokens), context, model, dropped=dropped, can_drop=True)


def known_tokens(backend: SlotBackend, tokens: list[int], field: str) -> list[int]:
    """Token ids a caller sent (`field`), as a list; bad_request naming the
    field when one is past the model's vocabulary."""
    vocabulary = backend.vocabulary_size()
    if any(token >= vocabulary for token in tokens):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"{field}: this model's token ids are below {vocabulary}",
        )
    return list(tokens)


def prompt_tokens(backend: SlotBackend, message: dict[str, Any]) -> list[int]:
    """A request's whole prompt as tokens (`prompt`, or `messages` through the
    chat template with the tools it offers), rendered and tokenized as
    fit_prompt does before any turn is dropped: what `tokenize` answers, and
    what a generation of it reports as its prompt tokens."""
    tools = backend.offered_tools(message)
    return backend.tokenize(backend.render_prompt(message, tools=tools))


def _room(params: SamplingParams, context: int) -> int:
    return max(1, min(params.max_tokens, context // 4))


def _role(item: Any) -> str:
    return item.get("role", "") if isinstance(item, dict) else ""


def _exceeded(
    count: int, context: int, model: str, *, dropped: int, can_drop: bool
) -> ProtocolError:
    name = f"{model}'s" if model else "this model's"
    if can_drop:
        what = (
            f"its {dropped} oldest messages dropped" if dropped else "no turn to drop"
        )
        detail = (
            f"with {what}, this conversation still has {count} tokens; {name} "
            f"context holds {context}: shorten the system prompt or the latest "
            "message"
        )
    else:
        detail = (
            f"this prompt has {count} tokens; {name} context holds {context}, "
            "answer included: shorten it, or set the model's context overflow to "
            "drop the oldest turns"
        )
    return ProtocolError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, detail)
