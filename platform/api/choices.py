"""An answer's choices: the engine requests that make them (each prompt's `n`
choices; each prompt of a completions list), which run as slots of the same
engine batch, and what comes back, in OpenAI's shapes: tool calls, the two
log-probability shapes (chat's and completions'), and usage counted over
every choice (a prompt once, however many choices it has)."""

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.wire.replies import (
    CalledTool,
    GenerateAnswer,
    Logprob,
    StartFrame,
    StreamEvent,
    ToolCallDelta,
    Usage,
)
from engines.wire.requests import GenerateRequest
from routing.affinity import prefix_keys

from . import bodies
from .calls import Call
from .pipeline import generation_open
from .schemas import ChatCompletionRequest, CompletionRequest

Priority = Literal["interactive", "batch"]
Payload = ChatCompletionRequest | CompletionRequest


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason for the engine's."""
    return reason if reason in ("length", "tool_calls") else "stop"


def call_requests(
    payload: Payload, priority: Priority, *, call: Call
) -> list[GenerateRequest]:
    """The engine requests of the call's choices, in choice order
    (Sampling.engine_requests), with the pipeline's envelope: the priority
    (a batch line yields to interactive requests in the engine), the caller
    (whose limits admitted it: the engine shares its slots fairly between
    callers) and the cache salt of the call's cache scope (the engine reuses
    a cached prefix only for the same salt, as vLLM's `cache_salt`). Each
    request's own id is unique across engines and their restarts, which
    engine ids are not. A chat's message prefixes, in the same scope, go on
    the call, for cache-aware routing."""
    envelope: dict[str, Any] = {}
    if priority != "interactive":
        envelope["priority"] = priority
    if call.caller:
        envelope["caller"] = call.caller
    scope = call.cache_scope
    if scope:
        envelope["cache_salt"] = cache_salt(scope)
    requests = payload.engine_requests(**envelope)
    if requests and requests[0].messages:
        call.prefixes = prefix_keys(
            payload.model, engine_messages(requests[0]), scope=scope
        )
    return requests


def cache_salt(scope: str) -> str:
    """The engine's name for a cache scope: a hash, so that engine logs and
    states name no key or user."""
    return hashlib.blake2b(scope.encode(), digest_size=16).hexdigest()


def engine_messages(request: GenerateRequest) -> list[dict[str, Any]]:
    """A chat request's messages as JSON objects (what a stored turn, and a
    prefix's routing key, are made of)."""
    return [turn.model_dump(exclude_none=True) for turn in request.messages or ()]


@dataclass
class ChoicesUsage:
    """Usage over an answer's choices: each prompt's tokens once (its first
    choice's count), every choice's completion tokens."""

    per_prompt: int
    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    completion: dict[int, int] = field(default_factory=dict)

    def started(self, index: int, start: StartFrame) -> None:
        if index % self.per_prompt == 0:
            self.prompt[index] = start.prompt_tokens

    def ended(self, index: int, usage: Usage) -> None:
        if index % self.per_prompt == 0:
            self.prompt[index] = usage.prompt_tokens
            self.cached[index] = usage.cached_tokens
        self.completion[index] = usage.completion_tokens

    def usage(self) -> Usage:
        """In the engine's shape, for Call.counted."""
        return Usage(
            prompt_tokens=sum(self.prompt.values()),
            completion_tokens=sum(self.completion.values()),
            cached_tokens=sum(self.cached.values()),
        )


# -- shapes --------------------------------------------------------------------


def chat_logprobs(entries: list[Logprob]) -> bodies.ChoiceLogprobs:
    """Chat's `logprobs` (the engine's entries are in its shape already)."""
    return bodies.ChoiceLogprobs(content=entries)


def completion_logprobs(
    entries: list[Logprob], offset: int
) -> tuple[bodies.CompletionLogprobs, int]:
    """Completions' `logprobs` for these tokens, the first at character
    `offset` of the choice's text; and the offset after them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for entry in entries:
        tokens.append(entry.token)
        token_logprobs.append(entry.logprob)
        # An echoed prompt's first token has no log-probability, nor top.
        top_logprobs.append(
            None
            if entry.logprob is None
            else {top.token: top.logprob for top in entry.top_logprobs}
        )
        text_offset.append(offset)
        offset += len(entry.token)
    logprobs = bodies.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=text_offset,
    )
    return logprobs, offset


def message_tool_calls(calls: list[CalledTool]) -> list[bodies.ToolCall]:
    """A message's `tool_calls` from the engine's complete calls."""
    return [
        bodies.ToolCall(
            id=call.id,
            function=bodies.CalledFunction(name=call.name, arguments=call.arguments),
        )
        for call in calls
    ]


def delta_tool_calls(deltas: list[ToolCallDelta]) -> list[bodies.ToolCallDelta]:
    """A chunk's `delta.tool_calls` from the engine's deltas: a call's id,
    type and name come with its first delta, its arguments in pieces."""
    out = []
    for delta in deltas:
        if delta.id is None:
            function = bodies.FunctionDelta(arguments=delta.arguments)
            out.append(bodies.ToolCallDelta(index=delta.index, function=function))
            continue
        function = bodies.FunctionDelta(
            name=delta.name or "", arguments=delta.arguments
        )
        out.append(
            bodies.ToolCallDelta(
                index=delta.index, id=delta.id, type="function", function=function
            )
        )
    return out


def tool_calls(calls: list[CalledTool]) -> list[dict[str, Any]]:
    """message_tool_calls as JSON (the WebSocket chat's messages)."""
    return [call.model_dump(mode="json") for call in message_tool_calls(calls)]


def tool_call_deltas(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """delta_tool_calls as JSON (the WebSocket chat's messages)."""
    return [delta.model_dump(mode="json") for delta in delta_tool_calls(deltas)]


def chat_message(reply: GenerateAnswer) -> bodies.ChatCompletionMessage:
    """The assistant message of a whole (non-streamed) answer: with tool
    calls, its text only if there is more than blanks."""
    if not reply.tool_calls:
        return bodies.ChatCompletionMessage(content=reply.text)
    return bodies.ChatCompletionMessage(
        content=reply.text if reply.text.strip() else None,
        tool_calls=message_tool_calls(reply.tool_calls),
    )


# -- streams -------------------------------------------------------------------------


async def choices_open(
    call: Call,
    requests: list[GenerateRequest],
    *,
    per_prompt: int,
) -> tuple[list[tuple[AsyncIterator[StreamEvent], StartFrame]], ChoicesUsage]:
    """Open every choice's engine stream at once (each waits for its slot);
    the streams and their start frames, in choice order, and the usage of
    their usage (the call counts their prompts' tokens from here). A refusal
    closes the ones already open and is raised."""
    tasks = [
        asyncio.ensure_future(generation_open(call, fields)) for fields in requests
    ]
    try:
        opened = list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                frames, _ = await task
                await frames.aclose()
        raise
    usage_count = ChoicesUsage(per_prompt=per_prompt)
    for index, (_, start) in enumerate(opened):
        usage_count.started(index, start)
    call.counted(usage_count.usage())  # the prompts', known at the start
    return opened, usage_count


async def merged(
    streams: list[AsyncIterator[StreamEvent]],
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The frames of several streams as they come, each with its choice's
    index; an error in one ends them all (raised here). One stream is
    relayed as it is."""
    if len(streams) == 1:
        async for frame in streams[0]:
            yield 0, frame
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(index: int, frames: AsyncIterator[StreamEvent]) -> None:
        try:
            async for frame in frames:
                queue.put_nowait((index, frame, None))
        except Exception as error:  # handed to the reader
            queue.put_nowait((index, None, error))
        finally:
            queue.put_nowait((index, ended, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, frame, error = await queue.get()
            if error is not None:
                raise error
            if frame is ended:
                running -= 1
                continue
            yield index, frame
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
