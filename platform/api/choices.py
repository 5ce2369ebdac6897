"""An answer's choices: the engine requests that make them (each prompt's `n`
choices; each prompt of a completions list), which run as slots of the same
engine batch, and what comes back, in OpenAI's shapes: tool calls, the two
log-probability shapes (chat's and completions'), and usage counted over
every choice (a prompt once, however many choices it has)."""

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.wire.frames import (
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

from .calls import Call
from .pipeline import generation_open
from .schemas import ChatCompletionRequest, CompletionRequest

Priority = Literal["interactive", "batch"]
Payload = ChatCompletionRequest | CompletionRequest


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason for the engine's."""
    return reason if reason in ("length", "tool_calls") else "stop"


def engine_requests(
    payload: Payload, priority: Priority, *, call: Call
) -> list[GenerateRequest]:
    """The engine requests of the call's choices, in choice order: the
    body's fields, our own request id (unique across engines and their
    restarts, which engine ids are not), the priority (a batch line yields
    to interactive requests in the engine) and the caller (whose limits
    admitted it: the engine shares its slots fairly between callers) and
    the cache salt of the call's cache scope (the engine reuses a cached
    prefix only for the same salt, as vLLM's `cache_salt`). A chat's message
    prefixes, in the same scope, go on the call, for cache-aware routing."""
    envelope: dict[str, Any] = {}
    if priority != "interactive":
        envelope["priority"] = priority
    if call.caller:
        envelope["caller"] = call.caller
    scope = call.cache_scope
    if scope:
        envelope["cache_salt"] = cache_salt(scope)
    requests = [
        request.model_copy(update={**envelope, "request_id": uuid.uuid4().hex})
        for request in payload.engine_requests()
    ]
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
class Tally:
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


def chat_logprobs(entries: list[Logprob]) -> dict[str, Any]:
    """Chat's `logprobs` (the engine's entries are in its shape already)."""
    return {"content": [entry.model_dump() for entry in entries], "refusal": None}


def completion_logprobs(
    entries: list[Logprob], offset: int
) -> tuple[dict[str, Any], int]:
    """Completions' `logprobs` for these tokens, the first at character
    `offset` of the choice's text; and the offset after them."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for entry in entries:
        out["tokens"].append(entry.token)
        out["token_logprobs"].append(entry.logprob)
        # An echoed prompt's first token has no log-probability, nor top.
        out["top_logprobs"].append(
            None
            if entry.logprob is None
            else {top.token: top.logprob for top in entry.top_logprobs}
        )
        out["text_offset"].append(offset)
        offset += len(entry.token)
    return out, offset


def tool_calls(calls: list[CalledTool]) -> list[dict[str, Any]]:
    """A message's `tool_calls` from the engine's complete calls."""
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


def tool_call_deltas(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """A chunk's `delta.tool_calls` from the engine's deltas: a call's id,
    type and name come with its first delta, its arguments in pieces."""
    out = []
    for delta in deltas:
        item: dict[str, Any] = {"index": delta.index}
        function: dict[str, str] = {"arguments": delta.arguments}
        if delta.id is not None:
            item["id"] = delta.id
            item["type"] = "function"
            function = {"name": delta.name or "", **function}
        item["function"] = function
        out.append(item)
    return out


def chat_message(reply: GenerateAnswer) -> dict[str, Any]:
    """The assistant message of a whole (non-streamed) answer."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["content"] = reply.text if reply.text.strip() else None
        message["tool_calls"] = tool_calls(reply.tool_calls)
    return message


# -- streams -------------------------------------------------------------------------


async def choices_open(
    call: Call,
    requests: list[GenerateRequest],
    *,
    per_prompt: int,
) -> tuple[list[tuple[AsyncIterator[StreamEvent], StartFrame]], Tally]:
    """Open every choice's engine stream at once (each waits for its slot);
    the streams and their start frames, in choice order, and the tally of
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
    tally = Tally(per_prompt=per_prompt)
    for index, (_, start) in enumerate(opened):
        tally.started(index, start)
    call.prompt_tokens = tally.usage().prompt_tokens
    return opened, tally


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
