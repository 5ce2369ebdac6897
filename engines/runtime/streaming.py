"""Serving one generation request on a connection: the request goes to its
model's runner, the decode thread's events come back as frames (a stream's
start, text chunks and final frame, or one whole answer), and a caller that
hangs up is cancelled."""

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from engines.generation.context import Prompt, fit_prompt
from engines.generation.runner import GenerationRequest, GenerationRunner
from engines.generation.sampling import SamplingParams
from engines.runtime.residency import ResidentModel
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.replies import (
    DoneFrame,
    ErrorReply,
    GenerateAnswer,
    Logprob,
    StartFrame,
    Timings,
    TokenFrame,
)
from engines.wire.requests import GenerateRequest

log = logging.getLogger("roundhouse.engine")

# Prompts up to this many characters are rendered and tokenized on the event
# loop (well under a millisecond); longer ones in a worker thread, so that one
# long prompt never holds up the other streams' frames.
INLINE_PROMPT_CHARS = 8192


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def _prompt_chars(request: GenerateRequest) -> int:
    if request.prompt is not None:
        return len(request.prompt)
    return sum(len(turn.content or "") for turn in request.messages or ())


def event_fields(event: dict[str, Any]) -> dict[str, Any]:
    """A decode-thread event's fields, but its `event` (the final ones become
    a DoneFrame, a GenerateAnswer or an ErrorReply)."""
    return {key: value for key, value in event.items() if key != "event"}


async def _prompt(
    model: ResidentModel,
    request: GenerateRequest,
    fields: dict[str, Any],
    params: SamplingParams,
) -> tuple[Prompt, Any]:
    """The request's prompt and, for a constrained answer, its grammar's
    matcher (compiled on first use: always off the event loop). The model's
    grammar tokenizer, where its log-probabilities need it, is built here
    too: never on the decode thread, where it would hold every slot up."""
    backend = model.runner.backend
    grammar = request.constrained
    vocabulary = bool(params.logprobs) and backend.logprobs_need_grammar_tokenizer

    def render() -> tuple[Prompt, Any]:
        prompt = fit_prompt(
            backend,
            fields,
            params,
            policy=model.spec.context_overflow,
            model=model.spec.name,
        )
        matcher = None
        if grammar:
            matcher = backend.grammars.matcher_for(request)
        if vocabulary:
            backend.grammars.load()
        return prompt, matcher

    if not (grammar or vocabulary) and _prompt_chars(request) <= INLINE_PROMPT_CHARS:
        return render()
    return await asyncio.get_running_loop().run_in_executor(model.executor, render)


async def serve_generation(
    model: ResidentModel,
    request: GenerateRequest,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    received: float,
    load_ms: float = 0.0,
    generations: dict[str, GenerationRunner],
    count_tokens: Callable[[int], None] = lambda _: None,
) -> None:
    """Run one generation, writing its frames: for generate_stream a start
    frame once a slot takes the request (with its `prompt_tokens`), one frame
    per text chunk and a final frame; for generate one frame with the whole
    text. `generations` maps request ids to runners (for
    `cancel` from another connection). The final frame's `timings` are measured
    from the request's arrival (a load it waited for included, and told
    apart: `load_ms`, measured by the caller)."""
    stream = request.kind == "generate_stream"
    runner = model.runner
    if runner is None:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"model {model.spec.name!r} does not generate"
        )
    first_token_ms: float | None = None
    # The prompt renderers and the sampling (engines/generation) read the
    # request's fields as a dict.
    fields = request.model_dump(exclude_none=True)
    params = SamplingParams.from_request(fields, model.spec.sampling)
    prompt, matcher = await _prompt(model, request, fields, params)
    prompt_tokens = prompt.tokens
    loop = asyncio.get_running_loop()
    # The decode thread's events land here (a pass's events for every stream
    # in one hand-over: handoff.Handoff); `ready` wakes this coroutine for
    # them or for the caller hanging up. Events that arrived together leave in
    # one write (a last token and the final frame, typically): each write wakes
    # the caller, which costs both sides CPU.
    events: collections.deque[dict] = collections.deque()
    ready = asyncio.Event()

    def arrived(event: dict) -> None:
        events.append(event)
        ready.set()

    def emit(event: dict) -> None:
        runner.handoff.call_soon(loop, arrived, event)

    generation = GenerationRequest(
        prompt_tokens=prompt_tokens,
        params=params,
        emit=emit,
        background=request.priority == "batch",
        caller=request.caller or "",
        cache_salt=request.cache_salt or "",
        matcher=matcher,
        tool_calls=request.offers_tools,
        prompt_logprobs=request.echo and params.logprobs,
    )
    if request.request_id:
        generation.id = request.request_id
    if generation.id in generations:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "request_id already in use")
    runner.submit(generation)
    generations[generation.id] = runner
    # The caller sends nothing while its request runs: end of stream on the
    # connection means it went away.
    hangup = asyncio.ensure_future(reader.read(1))
    hangup.add_done_callback(lambda _: ready.set())
    parts: list[str] = []
    logprobs: list[Logprob] = []
    prompt_logprobs: list[Logprob] = []
    final = False
    # A stream's start frame leaves once the request has a slot (the front
    # answers its HTTP status then): a request refused in the queue (full,
    # timed out, unloading) gets its error frame instead, before any start.
    started = not stream
    start = b""
    # `echo`: the prompt's text goes back with the start frame of a stream,
    # with the answer otherwise.
    echoed = runner.backend.detokenize(prompt_tokens) if request.echo else None
    if stream:
        start = StartFrame(
            request_id=generation.id,
            prompt_tokens=len(prompt_tokens),
            dropped_messages=prompt.dropped_messages,
            prompt_text=echoed,
        ).encoded()
    try:
        while True:
            await ready.wait()
            ready.clear()
            frames: list[bytes] = []
            while events and not final:
                event = events.popleft()
                if event["event"] == "admitted":
                    if not started:
                        frames.append(start)
                        started = True
                    continue
                if event["event"] == "token":
                    token = TokenFrame(**event)
                    count_tokens(token.tokens)
                    if first_token_ms is None:
                        first_token_ms = _ms_since(received)
                    if stream:
                        frames.append(token.encoded())
                    else:
                        parts.append(token.text)
                        logprobs.extend(token.logprobs or ())
                        prompt_logprobs.extend(token.prompt_logprobs or ())
                    continue
                final = True
                if event["event"] == "error":
                    frames.append(ErrorReply(**event_fields(event)).encoded())
                    continue
                if not started:  # cancelled while queued: a stream all the same
                    frames.append(start)
                    started = True
                ending = {
                    **event_fields(event),
                    "request_id": generation.id,
                    "dropped_messages": prompt.dropped_messages,
                    "timings": Timings(
                        first_token_ms=first_token_ms,
                        total_ms=_ms_since(received),
                        load_ms=round(load_ms, 3) if load_ms else None,
                    ),
                }
                if stream:
                    frames.append(DoneFrame(**ending).encoded())
                    continue
                answer = GenerateAnswer(
                    **ending,
                    text="".join(parts),
                    logprobs=logprobs if params.logprobs else None,
                    prompt_logprobs=(
                        prompt_logprobs if generation.prompt_logprobs else None
                    ),
                    prompt_text=echoed,
                )
                frames.append(answer.encoded())
            if frames:
                writer.write(b"".join(frames))
                await writer.drain()
            if final:
                return
            if hangup.done():
                log.info("caller of %s went away: cancelled", generation.id)
                return
    except (ConnectionError, OSError):
        pass  # the caller went away: cancelled below
    finally:
        if not final:  # hang-up, broken connection, or this task cancelled
            runner.cancel(generation.id)
        # Settle the watcher before the connection reads its next frame (two
        # readers on one stream is an error).
        hangup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hangup
        generations.pop(generation.id, None)
