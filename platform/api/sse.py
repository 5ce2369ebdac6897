"""Streamed answers of /v1/chat/completions and /v1/completions (server-sent
events, OpenAI's chunks): every choice's engine stream opened at once, their
tokens relayed as they come (api.token_relay), each chunk naming its choice; a
choice's last chunk carries its finish reason, and the stream ends with the
usage of every choice (when asked for) and `[DONE]`."""

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpResponse, StreamingHttpResponse
from pydantic import MISSING, BaseModel

from engines.wire.client import EngineError
from engines.wire.replies import Ending, Logprob, StartFrame, TokenFrame

from . import bodies
from .calls import Call
from .choices import (
    Payload,
    call_requests,
    chat_logprobs,
    choices_open,
    completion_logprobs,
    delta_tool_calls,
)
from .pipeline import engine_failure
from .token_relay import Echo, Ended, Token, tokens_relayed

# The answer's header naming how many of the oldest messages were dropped to fit
# the model's context.
DROPPED_HEADER = "X-Roundhouse-Dropped-Messages"


def sse(data: BaseModel | dict | str) -> bytes:
    """One event: a body (api.bodies), a JSON object, or `[DONE]`."""
    if isinstance(data, BaseModel):
        text = data.model_dump_json()
    elif isinstance(data, dict):
        text = json.dumps(data, separators=(",", ":"))
    else:
        text = data
    return f"data: {text}\n\n".encode()


async def streams_closed(relay: AsyncIterator[Any], opened: list) -> None:
    """A stream's end, however it ends: the relay first (it stops reading the
    engine's streams), then hanging up on the engine, which cancels the
    requests there. `opened`: (frames, start) of each engine stream."""
    await relay.aclose()
    for frames, _ in opened:
        await frames.aclose()


def streaming_response(
    content: AsyncIterator[bytes],
    frame: StartFrame | Ending | None,
    *,
    content_type: str = "text/event-stream",
) -> StreamingHttpResponse:
    """A streamed answer (SSE, or a dialect's NDJSON): never cached, never held
    back by a proxy, with the header naming the fields the engine dropped
    (its first frame's; none for a stream that is not an engine's)."""
    response = StreamingHttpResponse(content, content_type=content_type)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must not hold tokens back
    if frame is not None:
        dropped_header(response, frame)
    return response


def dropped_header(response: HttpResponse, frame: StartFrame | Ending) -> None:
    """How many of the oldest messages the engine dropped to fit the model's
    context (its context overflow setting allows it): the answer's header."""
    if frame.dropped_messages:
        response[DROPPED_HEADER] = str(frame.dropped_messages)


async def generation_stream(
    call: Call,
    payload: Payload,
    *,
    chat: bool,
) -> StreamingHttpResponse:
    """The streamed answer; its headers leave once every choice has a slot
    (a refusal before that is the answer's error status)."""
    requests = call_requests(payload, "interactive", call=call)
    created = int(time.time())
    opened, usage_count = await choices_open(
        call, requests, per_prompt=payload.choices_per_prompt
    )
    first_start = opened[0][1]
    # What every chunk says (its `object` is the body's own).
    chunk_body = bodies.ChatCompletionChunk if chat else bodies.CompletionChunk
    base: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + first_start.request_id,
        "created": created,
        "model": call.model,
    }
    if payload.include_usage:
        base["usage"] = None
    # Completions: the text offset of each choice's next token (echo first).
    offsets = [0] * len(opened)
    echoes = [""] * len(opened)
    if not chat and payload.echo:
        for index, ((_, start), request) in enumerate(
            zip(opened, requests, strict=True)
        ):
            echoes[index] = request.prompt or start.prompt_text or ""
            offsets[index] = len(echoes[index])

    def chunk(
        index: int,
        text: str = "",
        entries: list[Logprob] | None = None,
        frame: TokenFrame | None = None,
        reason: str | None = None,
        timings: dict[str, Any] | None = None,
    ) -> bytes:
        """One choice's chunk: text, log-probabilities and a token frame's
        tool-call deltas, or its finish `reason` and `timings`."""
        choice: bodies.ChatCompletionChunkChoice | bodies.CompletionChunkChoice
        if chat:
            tools = frame.tool_calls if frame else None
            delta = bodies.ChoiceDelta(
                content=text or MISSING,
                tool_calls=delta_tool_calls(tools) if tools else MISSING,
            )
            choice = bodies.ChatCompletionChunkChoice(
                index=index,
                delta=delta,
                logprobs=chat_logprobs(entries) if entries else None,
                finish_reason=reason,
            )
        else:
            logprobs = None
            if entries:
                logprobs, offsets[index] = completion_logprobs(entries, offsets[index])
            choice = bodies.CompletionChunkChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=reason
            )
        ending = MISSING if timings is None else timings
        return sse(chunk_body(**base, choices=[choice], timings=ending))

    async def content() -> AsyncIterator[bytes]:
        # Every write to the client is a send() that wakes it, which costs the
        # front 0.2-0.3 ms of CPU on a small VM: chunks due at the same moment
        # leave together. The response's headers tell the client that the engine
        # admitted the request; each choice's role chunk (or echoed prompt)
        # waits for its first token (or its end) and leaves in its write.
        pending = [b""] * len(opened)
        for index in range(len(opened)):
            if chat:
                first = bodies.ChatCompletionChunkChoice(
                    index=index,
                    delta=bodies.ChoiceDelta(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                )
                pending[index] = sse(chunk_body(**base, choices=[first]))
            elif echoes[index] and payload.logprobs is None:
                pending[index] = chunk(index, echoes[index])
        relay = tokens_relayed(call, opened, usage_count)
        try:
            async for event in relay:
                index = event.index
                if isinstance(event, Echo):
                    # The echoed prompt leaves with its log-probabilities.
                    offsets[index] = 0
                    pending[index] = chunk(index, echoes[index], event.logprobs)
                elif isinstance(event, Token):
                    frame = event.frame
                    piece = chunk(index, frame.text, frame.logprobs, frame)
                    yield pending[index] + piece
                    pending[index] = b""
                elif isinstance(event, Ended):
                    timings = call.timings(event.frame)
                    ending = chunk(index, reason=event.reason, timings=timings)
                    out = pending[index] + ending
                    pending[index] = b""
                    if not event.last:
                        yield out
                        continue
                    # The last choice's end leaves with the usage and [DONE].
                    last = [out]
                    if payload.include_usage:
                        usage = {**base, "usage": call.usage()}
                        last.append(sse(chunk_body(**usage, choices=[])))
                    last.append(sse("[DONE]"))
                    yield b"".join(last)
        except EngineError as failure:
            # Headers are sent: the failure travels as an error event.
            error = engine_failure(failure)
            call.failed_with(error)
            yield b"".join(pending) + sse(error.body())
        finally:
            await streams_closed(relay, opened)

    return streaming_response(content(), first_start)
