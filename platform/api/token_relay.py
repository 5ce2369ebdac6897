"""The token relay of a streamed answer, written once for both transports:
the server-sent events of /v1/chat/completions and /v1/completions (api.sse)
and the WebSocket chat (chat.streams). They only format what it yields.

It reads every choice's engine frames as they come (api.choices.merged) and
keeps the call's account: the first token's time, the completion tokens as
they come (a stream cut short gets no final usage, yet its tokens counted),
each choice's usage at its end (api.choices.ChoicesUsage) and, once every
choice has ended, the engine's final count. What a transport has to send comes out as
`Echo` (an echoed prompt's log-probabilities), `Token` (a choice's text,
tool-call deltas and log-probabilities) and `Ended` (a choice's finish).
(calls.StreamBody is the HTTP body of a stream, which ends its call.)
"""

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engines.wire.replies import DoneFrame, Logprob, StartFrame, TokenFrame

from .calls import Call
from .choices import ChoicesUsage, finish_reason, merged

__all__ = ["Echo", "Ended", "Token", "tokens_relayed"]


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt, scored: its log-probabilities."""

    index: int
    logprobs: list[Logprob]


@dataclass(frozen=True)
class Token:
    """A choice's next chunk: text, tool-call deltas, log-probabilities."""

    index: int
    frame: TokenFrame


@dataclass(frozen=True)
class Ended:
    """A choice's end: its `done` frame and OpenAI's finish reason for it.
    `last`: every choice has ended, and the call has the engine's count."""

    index: int
    frame: DoneFrame
    reason: str
    last: bool


async def tokens_relayed(
    call: Call,
    opened: list[tuple[AsyncIterator, StartFrame]],
    usage_count: ChoicesUsage,
    *,
    first_token: Callable[[], None] | None = None,
) -> AsyncIterator[Echo | Token | Ended]:
    """The answer's events as its choices' frames come, until every choice
    has ended; an engine's failure is raised (EngineError). `first_token`
    runs when the first token arrives. Closing this stops reading the engine
    streams (closing them, which hangs up on the engines, is the call's)."""
    frames = merged([stream for stream, _ in opened])
    ended = 0
    try:
        async for index, frame in frames:
            if isinstance(frame, TokenFrame):
                if call.first_token_at is None:
                    call.first_token_at = time.perf_counter()
                    if first_token is not None:
                        first_token()
                call.generated(frame.tokens)
                if frame.prompt_logprobs:
                    yield Echo(index, frame.prompt_logprobs)
                # Tokens inside a call's markup bring nothing: counted only.
                if frame.text or frame.tool_calls or frame.logprobs:
                    yield Token(index, frame)
            elif isinstance(frame, DoneFrame):
                usage_count.ended(index, frame.usage)
                ended += 1
                last = ended == len(opened)
                if last:
                    call.counted(usage_count.usage())
                yield Ended(index, frame, finish_reason(frame.finish_reason), last)
                if last:
                    return
    finally:
        await frames.aclose()
