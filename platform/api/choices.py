"""An answer's choices: the engine requests that make them (each prompt's `n`
choices; each prompt of a completions list), which run as slots of the same
engine batch, and what comes back, in OpenAI's shapes: tool calls, the two
log-probability shapes (chat's and completions'), and usage counted over
every choice (a prompt once, however many choices it has)."""

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from routing.affinity import prefix_keys
from routing.select import ModelRoute, Snapshot

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
) -> list[dict[str, Any]]:
    """The engine requests of the call's choices, in choice order: the
    body's fields, our own request id (unique across engines and their
    restarts, which engine ids are not), the priority (a batch line yields
    to interactive requests in the engine) and the caller (whose limits
    admitted it: the engine shares its slots fairly between callers). A
    chat's message prefixes go on the call, for cache-aware routing."""
    requests = payload.engine_requests()
    for fields in requests:
        fields["request_id"] = uuid.uuid4().hex
        if priority != "interactive":
            fields["priority"] = priority
        if call.caller:
            fields["caller"] = call.caller
    if requests and requests[0].get("messages"):
        call.prefixes = prefix_keys(payload.model, requests[0]["messages"])
    return requests


@dataclass
class Tally:
    """Usage over an answer's choices: each prompt's tokens once (its first
    choice's count), every choice's completion tokens."""

    per_prompt: int
    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    completion: dict[int, int] = field(default_factory=dict)

    def started(self, index: int, start: dict[str, Any]) -> None:
        if index % self.per_prompt == 0:
            self.prompt[index] = int(start.get("prompt_tokens", 0))

    def ended(self, index: int, usage: dict[str, Any]) -> None:
        if index % self.per_prompt == 0:
            self.prompt[index] = int(usage.get("prompt_tokens", 0))
            self.cached[index] = int(usage.get("cached_tokens", 0))
        self.completion[index] = int(usage.get("completion_tokens", 0))

    def usage(self) -> dict[str, int]:
        """In the engine's shape, for Call.counted."""
        return {
            "prompt_tokens": sum(self.prompt.values()),
            "completion_tokens": sum(self.completion.values()),
            "cached_tokens": sum(self.cached.values()),
        }


# -- shapes --------------------------------------------------------------------


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat's `logprobs` (the engine's entries are in its shape already)."""
    return {"content": entries, "refusal": None}


def completion_logprobs(
    entries: list[dict[str, Any]], offset: int
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
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        # An echoed prompt's first token has no log-probability, nor top.
        out["top_logprobs"].append(
            None
            if entry["logprob"] is None
            else {top["token"]: top["logprob"] for top in entry["top_logprobs"]}
        )
        out["text_offset"].append(offset)
        offset += len(entry["token"])
    return out, offset


def tool_calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """A message's `tool_calls` from the engine's complete calls."""
    return [
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]},
        }
        for call in calls
    ]


def tool_call_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chunk's `delta.tool_calls` from the engine's deltas: a call's id,
    type and name come with its first delta, its arguments in pieces."""
    out = []
    for delta in deltas:
        item: dict[str, Any] = {"index": delta["index"]}
        function: dict[str, str] = {"arguments": delta.get("arguments", "")}
        if "id" in delta:
            item["id"] = delta["id"]
            item["type"] = "function"
            function = {"name": delta["name"], **function}
        item["function"] = function
        out.append(item)
    return out


def chat_message(reply: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a whole (non-streamed) answer."""
    text = reply.get("text", "")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reply.get("tool_calls"):
        message["content"] = text if text.strip() else None
        message["tool_calls"] = tool_calls(reply["tool_calls"])
    return message


# -- streams -------------------------------------------------------------------------


async def choices_open(
    call: Call,
    route: ModelRoute,
    snapshot: Snapshot,
    requests: list[dict],
    *,
    per_prompt: int,
) -> tuple[list[tuple[AsyncIterator[dict], dict]], Tally]:
    """Open every choice's engine stream at once (each waits for its slot);
    the streams and their start frames, in choice order, and the tally of
    their usage (the call counts their prompts' tokens from here). A refusal
    closes the ones already open and is raised."""
    tasks = [
        asyncio.ensure_future(generation_open(call, route, snapshot, fields))
        for fields in requests
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
    call.prompt_tokens = tally.usage()["prompt_tokens"]
    return opened, tally


async def merged(
    streams: list[AsyncIterator[dict]],
) -> AsyncIterator[tuple[int, dict]]:
    """The frames of several streams as they come, each with its choice's
    index; an error in one ends them all (raised here). One stream is
    relayed as it is."""
    if len(streams) == 1:
        async for frame in streams[0]:
            yield 0, frame
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(index: int, frames: AsyncIterator[dict]) -> None:
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
