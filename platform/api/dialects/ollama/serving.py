"""Ollama's generation and embedding calls translated onto the pipeline's own
requests (api.schemas: ChatCompletionRequest, CompletionRequest,
EmbeddingRequest), served by the same steps (api.answers, api.choices,
api.token_relay), and answered in Ollama's shapes: one JSON object, or with
`stream` (Ollama's default) one object per line (NDJSON), the last with
`done: true`, why it ended, and the counts and times in nanoseconds.

/api/generate applies the model's chat template to its prompt (a chat of
`system` and the prompt), as Ollama does; with `raw`, or for a model with no
chat template (task `completion`), the prompt is sent as it is."""

import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from pydantic import BaseModel

from engines.wire.client import EngineError
from engines.wire.replies import Ending

from ... import errors
from ...answers import embedding_answer, generation_answer
from ...calls import Call
from ...choices import call_requests, choices_open
from ...gateway import front_gateway
from ...pipeline import engine_failure, with_engine
from ...schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_object,
)
from ...sse import dropped_header, streaming_response, streams_closed
from ...token_relay import Ended, Token, tokens_relayed
from . import protocol

log = logging.getLogger("roundhouse.api")

NDJSON = "application/x-ndjson"
# A load ahead (an empty prompt) may read gigabytes from disk: as long as an
# operator's load order waits (fleet.services.MODEL_LOAD_TIMEOUT_S).
LOAD_TIMEOUT_S = 600.0
# Options with the same name and meaning in the pipeline's requests.
SAMPLING_OPTIONS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
# Those the pipeline's requests lack, sent to the engine as they are (bounded
# there: engines.wire.bounds.check_sampling, a 400 naming them).
ENGINE_OPTIONS = ("top_k", "min_p", "repeat_penalty")


class _OllamaFields(BaseModel):
    """What Ollama's requests carry beyond OpenAI's: the engine's own samplers
    its options name, and the request's keep-alive (seconds); sent to the
    engine where set."""

    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    keep_alive_s: float | None = None

    def engine_fields(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in (*ENGINE_OPTIONS, "keep_alive_s")}
        mine = {name: value for name, value in out.items() if value is not None}
        return {**super().engine_fields(), **mine}


class OllamaChat(_OllamaFields, ChatCompletionRequest):
    """A chat request with Ollama's samplers and keep-alive."""


class OllamaCompletion(_OllamaFields, CompletionRequest):
    """A completion request with Ollama's samplers and keep-alive."""


# -- requests ----------------------------------------------------------------------


def _unsupported(field: str, why: str) -> errors.ApiError:
    return errors.invalid_request(f"'{field}' is not supported here: {why}.")


def _common(body: protocol.Generation) -> dict[str, Any]:
    """The OpenAI-shaped fields of what chat and generate share: sampling
    options, the answer's length and format."""
    if body.think not in (None, False):
        raise _unsupported("think", "no model served here has a thinking mode")
    if body.logprobs:
        raise _unsupported("logprobs", "use /v1/chat/completions for them")
    fields: dict[str, Any] = {"model": body.model}
    if body.keep_alive is not None:
        fields["keep_alive_s"] = body.keep_alive
    options = body.options or protocol.Options()
    for name in (*SAMPLING_OPTIONS, *ENGINE_OPTIONS):
        value = getattr(options, name)
        if value is not None:
            fields[name] = value
    if options.seed is not None and options.seed >= 0:  # -1: a random seed
        fields["seed"] = options.seed
    if options.stop:
        fields["stop"] = options.stop
    # -1 (endless) and -2 (to the context's end): up to the context's end.
    if options.num_predict is not None and options.num_predict > 0:
        fields["max_tokens"] = options.num_predict
    fmt = body.format
    if fmt == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": fmt},
        }
    return fields


def chat_request(body: protocol.ChatBody) -> OllamaChat:
    """The chat completion request of an /api/chat body (400 for what cannot
    be served)."""
    messages = []
    # Ollama's tool messages name the tool, not the call: each answers the
    # oldest call not yet answered (of that name, if one is).
    unanswered: list[tuple[str, str]] = []
    for number, message in enumerate(body.messages):
        if message.images:
            raise _unsupported(
                f"messages.{number}.images", "no model served here reads images"
            )
        out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
        if message.tool_calls:
            calls = []
            for index, call in enumerate(message.tool_calls):
                call_id = call.id or f"call_{number}_{index}"
                unanswered.append((call_id, call.function.name))
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": json.dumps(call.function.arguments),
                        },
                    }
                )
            out["tool_calls"] = calls
        if message.role == "tool":
            call_id = message.tool_call_id or _answered(unanswered, message.tool_name)
            if call_id is not None:
                out["tool_call_id"] = call_id
        messages.append(out)
    fields = _common(body)
    fields["messages"] = messages
    if body.tools:
        fields["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return parse_object(OllamaChat, fields)


def _answered(unanswered: list[tuple[str, str]], name: str | None) -> str | None:
    """The call a tool message answers (taken from `unanswered`)."""
    for position, (call_id, called) in enumerate(unanswered):
        if name is None or called == name:
            del unanswered[position]
            return call_id
    if unanswered:
        return unanswered.pop(0)[0]
    return None


def generate_request(
    body: protocol.GenerateBody, *, task: str
) -> OllamaChat | OllamaCompletion:
    """The request of an /api/generate body: a chat of its system and prompt
    (the model's template applied), or with `raw` (or a model without a chat
    template) a completion of the prompt as it is."""
    if body.images:
        raise _unsupported("images", "no model served here reads images")
    for name in ("suffix", "template"):
        if getattr(body, name):
            raise _unsupported(name, "the model's own chat template is applied")
    if body.context:
        raise _unsupported(
            "context", "send the conversation to /api/chat as messages instead"
        )
    fields = _common(body)
    if body.raw or task == "completion":
        prompt = body.prompt
        if body.system and not body.raw:
            prompt = f"{body.system}\n\n{prompt}"
        fields["prompt"] = prompt
        fields.setdefault("max_tokens", None)  # no 16-token default: Ollama's
        return parse_object(OllamaCompletion, fields)
    messages = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    messages.append({"role": "user", "content": body.prompt})
    fields["messages"] = messages
    return parse_object(OllamaChat, fields)


def embedding_request(body: protocol.EmbedBody | protocol.EmbeddingsBody):
    texts = body.prompt if isinstance(body, protocol.EmbeddingsBody) else body.input
    fields: dict[str, Any] = {"model": body.model, "input": texts}
    if getattr(body, "dimensions", None) is not None:
        fields["dimensions"] = body.dimensions
    return parse_object(EmbeddingRequest, fields)


# -- answers -----------------------------------------------------------------------


def now_text() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def done_reason(finish_reason: str) -> str:
    """Ollama's: `length` when the answer hit its limit, `stop` otherwise (a
    tool call too)."""
    return "length" if finish_reason == "length" else "stop"


def final(call: Call, ending: Ending) -> dict[str, Any]:
    """The last object's counts and times, in nanoseconds: the whole call's
    (as this front saw it), the model's load (what the engine waited for it
    to be loaded; 0 when it was resident), the prompt's (from then to the
    first token, as the engine saw it: a wait for a slot included) and the
    answer's (the rest)."""
    timings = ending.timings
    total_ms, load_ms = timings.total_ms, timings.load_ms or 0.0
    first_ms = total_ms if timings.first_token_ms is None else timings.first_token_ms
    return {
        "done_reason": done_reason(ending.finish_reason),
        "total_duration": int((time.perf_counter() - call.started) * 1e9),
        "load_duration": int(load_ms * 1e6),
        "prompt_eval_count": call.prompt_tokens,
        "prompt_eval_duration": int(max(0.0, first_ms - load_ms) * 1e6),
        "eval_count": call.completion_tokens,
        "eval_duration": int(max(0.0, total_ms - first_ms) * 1e6),
    }


def tool_calls_out(calls) -> list[protocol.ToolCall]:
    """Ollama's tool calls (arguments an object) of the engine's complete
    calls (arguments as JSON text)."""
    out = []
    for called in calls:
        try:
            arguments = json.loads(called.arguments or "{}")
        except ValueError:
            arguments = {}
        if not isinstance(arguments, dict):
            arguments = {"value": arguments}
        out.append(
            protocol.ToolCall(
                function=protocol.CalledFunction(name=called.name, arguments=arguments)
            )
        )
    return out


def _line(body: BaseModel | dict) -> bytes:
    if isinstance(body, BaseModel):
        return body.model_dump_json().encode() + b"\n"
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


async def loaded(call: Call, body: protocol.Generation, *, chat: bool) -> HttpResponse:
    """Nothing to answer (an empty prompt, no messages): Ollama's way to load
    a model ahead (tools warm one up so), or with keep_alive 0 to unload it.
    A load goes to the engine the request is routed to, which keeps the
    model for the keep-alive asked (load_duration: the load as this front
    waited for it); an unload to every engine that could hold it
    (`unloaded`)."""
    started = time.perf_counter()
    if body.keep_alive == 0:
        await unloaded(call)
        reason, load_ns = "unload", 0
    else:
        await with_engine(
            call,
            lambda client: client.load(
                call.model, keep_alive_s=body.keep_alive, timeout=LOAD_TIMEOUT_S
            ),
        )
        reason, load_ns = "load", int((time.perf_counter() - started) * 1e9)
    shape = protocol.ChatChunk if chat else protocol.GenerateChunk
    text = {"message": protocol.AnswerMessage(content="")} if chat else {"response": ""}
    answer = shape(
        model=call.model,
        created_at=now_text(),
        done=True,
        done_reason=reason,
        total_duration=int((time.perf_counter() - call.started) * 1e9),
        load_duration=load_ns,
        **text,
    )
    return JsonResponse(answer.model_dump(mode="json"))


async def unloaded(call: Call) -> None:
    """Ask every engine that serves the model's format and is up to unload it
    as its keep-alive would (engines.wire.requests.UnloadRequest.when_idle):
    now where it is idle, once its requests end where it is busy; nothing
    where it is not resident, or is kept until its memory is needed. An
    engine that cannot be asked is logged and skipped: its keep-alive still
    applies there."""
    route, snapshot = call.route, call.snapshot
    assert route is not None and snapshot is not None, "model_route first"
    gateway = front_gateway()
    for name, status in sorted(snapshot.engines.items()):
        if not status.usable_for(route.format):
            continue
        try:
            await gateway.client(name, snapshot).unload(call.model, when_idle=True)
        except EngineError as error:
            log.warning("engine %s could not unload %s: %s", name, call.model, error)


async def generation(
    call: Call, payload: OllamaChat | OllamaCompletion, *, stream: bool, chat: bool
) -> HttpResponse:
    """The answer, as /api/chat's (`chat`) or /api/generate's: whole, or
    streamed as NDJSON."""
    if stream:
        return await _stream(call, payload, chat=chat)
    templated = isinstance(payload, OllamaChat)
    body, reply = await generation_answer(call, payload, chat=templated)
    choice = body["choices"][0]
    text = (choice.get("message") or {}).get("content") if templated else choice["text"]
    shape: dict[str, Any] = {
        "model": call.model,
        "created_at": now_text(),
        "done": True,
        **final(call, reply),
    }
    if chat:
        answer = protocol.AnswerMessage(content=text or "")
        if reply.tool_calls:
            answer.tool_calls = tool_calls_out(reply.tool_calls)
        out = protocol.ChatChunk(message=answer, **shape)
    else:
        out = protocol.GenerateChunk(response=text or "", **shape)
    response = JsonResponse(out.model_dump(mode="json"))
    dropped_header(response, reply)
    return response


async def _stream(
    call: Call, payload: OllamaChat | OllamaCompletion, *, chat: bool
) -> StreamingHttpResponse:
    """One object per line: the answer's text as it comes, then (a chat's
    tool calls, whole, as Ollama sends them, and) the last object. Its
    headers leave once a slot took the request (a refusal before that is
    the answer's status)."""
    requests = call_requests(payload, "interactive", call=call)
    opened, usage_count = await choices_open(call, requests, per_prompt=1)

    def piece(text: str = "", calls=None, **last: Any) -> bytes:
        shape: dict[str, Any] = {"model": call.model, "created_at": now_text()}
        if chat:
            message = protocol.AnswerMessage(content=text)
            if calls:
                message.tool_calls = calls
            body = protocol.ChatChunk(message=message, done=bool(last), **shape, **last)
        else:
            body = protocol.GenerateChunk(
                response=text, done=bool(last), **shape, **last
            )
        return _line(body)

    async def content() -> AsyncIterator[bytes]:
        relay = tokens_relayed(call, opened, usage_count)
        try:
            async for event in relay:
                if isinstance(event, Token) and event.frame.text:
                    yield piece(event.frame.text)
                elif isinstance(event, Ended):
                    out = b""
                    if chat and event.frame.tool_calls:
                        out = piece(calls=tool_calls_out(event.frame.tool_calls))
                    yield out + piece(**final(call, event.frame))
        except EngineError as failure:
            # The answer has started: the failure travels as its last line.
            error = engine_failure(failure)
            call.failed_with(error)
            yield _line({"error": error.message})
        finally:
            await streams_closed(relay, opened)

    return streaming_response(content(), opened[0][1], content_type=NDJSON)


async def embedding(
    call: Call,
    payload: EmbeddingRequest,
    *,
    legacy: bool,
    keep_alive_s: float | None = None,
) -> HttpResponse:
    """/api/embed's answer (every input's vector), or /api/embeddings' (the
    one prompt's); the model then kept for `keep_alive_s` (None: its own
    keep-alive)."""
    answer = await embedding_answer(call, payload, keep_alive_s=keep_alive_s)
    vectors = [row["embedding"] for row in answer["data"]]
    if legacy:
        out: BaseModel = protocol.EmbeddingsResponse(embedding=vectors[0])
    else:
        out = protocol.EmbedResponse(
            model=call.model,
            embeddings=vectors,
            total_duration=int((time.perf_counter() - call.started) * 1e9),
            load_duration=int(call.load_ms * 1e6),
            prompt_eval_count=call.prompt_tokens,
        )
    return JsonResponse(out.model_dump(mode="json"))
