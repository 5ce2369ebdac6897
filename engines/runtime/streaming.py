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
from engines.wire.errors import ErrorCode, ProtocolError, error_frame
from engines.wire.framing import encode_message
from engines.wire.requests import GenerateRequest

log = logging.getLogger("roundhouse.engine")

# Prompts up to this many characters are rendered and tokenized on the event
# loop (well under a millisecond); longer ones in a worker thread, so that one
# long prompt never holds up the other streams' frames.
INLINE_PROMPT_CHARS = 8192


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def _prompt_chars(message: dict) -> int:
    if isinstance(message.get("prompt"), str):
        return len(message["prompt"])
    messages = message.get("messages")
    if isinstance(messages, list):
        return sum(
            len(item.get("content") or "") if isinstance(item, dict) else 0
            for item in messages
        )
    return 0


async def _prompt(
    model: ResidentModel,
    message: dict,
    typed: GenerateRequest,
    params: SamplingParams,
) -> tuple[Prompt, Any]:
    """The request's prompt and, for a constrained answer, its grammar's
    matcher (compiled on first use: always off the event loop). The model's
    grammar tokenizer, where its log-probabilities need it, is built here
    too: never on the decode thread, where it would hold every slot up."""
    backend = model.runner.backend
    grammar = typed.constrained
    vocabulary = bool(params.logprobs) and backend.logprobs_need_grammar_tokenizer

    def render() -> tuple[Prompt, Any]:
        prompt = fit_prompt(
            backend,
            message,
            params,
            policy=model.spec.context_overflow,
            model=model.spec.name,
        )
        matcher = None
        if grammar:
            matcher = backend.grammars.matcher_for(typed)
        if vocabulary:
            backend.grammars.load()
        return prompt, matcher

    if not (grammar or vocabulary) and _prompt_chars(message) <= INLINE_PROMPT_CHARS:
        return render()
    return await asyncio.get_running_loop().run_in_executor(model.executor, render)


async def serve_generation(
    model: ResidentModel,
    message: dict,
    typed: GenerateRequest,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    received: float,
    generations: dict[str, GenerationRunner],
    count_tokens: Callable[[int], None] = lambda _: None,
) -> None:
    """Run one generation, writing its frames: for generate_stream a start
    frame once a slot takes the request (with its `prompt_tokens`), one frame
    per text chunk and a final frame; for generate one frame with the whole
    text. `generations` maps request ids to runners (for
    `cancel` from another connection). The final frame's `timings` are measured
    from the request's arrival (a load it waited for included)."""
    stream = message["kind"] == "generate_stream"
    runner = model.runner
    if runner is None:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"model {model.spec.name!r} does not generate"
        )
    first_token_ms: float | None = None
    params = SamplingParams.from_request(message, model.spec.sampling)
    prompt, matcher = await _prompt(model, message, typed, params)
    prompt_tokens = prompt.tokens
    loop = asyncio.get_running_loop()
    # The decode thread's events land here; `ready` wakes this coroutine for
    # them or for the caller hanging up. Events that arrived together leave in
    # one write (a last token and the final frame, typically): each write wakes
    # the caller, which costs both sides CPU.
    events: collections.deque[dict] = collections.deque()
    ready = asyncio.Event()

    def arrived(event: dict) -> None:
        events.append(event)
        ready.set()

    def emit(event: dict) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed at exit
            loop.call_soon_threadsafe(arrived, event)

    request = GenerationRequest(
        prompt_tokens=prompt_tokens,
        params=params,
        emit=emit,
        background=message.get("priority") == "batch",
        caller=typed.caller or "",
        matcher=matcher,
        tool_calls=typed.offers_tools,
        prompt_logprobs=typed.echo and params.logprobs,
    )
    if message.get("request_id"):
        request.id = message["request_id"]
    if request.id in generations:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "request_id already in use")
    runner.submit(request)
    generations[request.id] = runner
    # The caller sends nothing while its request runs: end of stream on the
    # connection means it went away.
    hangup = asyncio.ensure_future(reader.read(1))
    hangup.add_done_callback(lambda _: ready.set())
    parts: list[str] = []
    logprobs: list[dict] = []
    prompt_logprobs: list[dict] = []
    final = False
    # A stream's start frame leaves once the request has a slot (the front
    # answers its HTTP status then): a request refused in the queue (full,
    # timed out, unloading) gets its error frame instead, before any start.
    started = not stream
    start = b""
    # `echo`: the prompt's text goes back with the start frame of a stream,
    # with the answer otherwise.
    echoed = (
        {"prompt_text": runner.backend.detokenize(prompt_tokens)} if typed.echo else {}
    )
    if stream:
        start = encode_message(
            {
                "status": "ok",
                "event": "start",
                "request_id": request.id,
                "prompt_tokens": len(prompt_tokens),
                "dropped_messages": prompt.dropped_messages,
                **echoed,
            }
        )
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
                    count_tokens(int(event.get("tokens", 1)))
                    if first_token_ms is None:
                        first_token_ms = _ms_since(received)
                    if stream:
                        frames.append(encode_message({"status": "ok", **event}))
                    else:
                        parts.append(event["text"])
                        logprobs.extend(event.get("logprobs", ()))
                        prompt_logprobs.extend(event.get("prompt_logprobs", ()))
                    continue
                final = True
                if event["event"] == "error":
                    reply = error_frame(event["code"], event["message"])
                else:
                    if not started:  # cancelled while queued: a stream all the same
                        frames.append(start)
                        started = True
                    reply = {"status": "ok", **event, "request_id": request.id}
                    reply["dropped_messages"] = prompt.dropped_messages
                    reply["timings"] = {
                        "first_token_ms": first_token_ms,
                        "total_ms": _ms_since(received),
                    }
                    if not stream:
                        reply.update(echoed)
                        reply["text"] = "".join(parts)
                        if params.logprobs:
                            reply["logprobs"] = logprobs
                        if request.prompt_logprobs:
                            reply["prompt_logprobs"] = prompt_logprobs
                frames.append(encode_message(reply))
            if frames:
                writer.write(b"".join(frames))
                await writer.drain()
            if final:
                return
            if hangup.done():
                log.info("caller of %s went away: cancelled", request.id)
                return
    except (ConnectionError, OSError):
        pass  # the caller went away: cancelled below
    finally:
        if not final:  # hang-up, broken connection, or this task cancelled
            runner.cancel(request.id)
        # Settle the watcher before the connection reads its next frame (two
        # readers on one stream is an error).
        hangup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hangup
        generations.pop(request.id, None)
