"""The OpenAI-compatible REST API (/healthz and /metrics: api.health).

Every API request goes: size cap → key → typed body → model (exists, allowed,
right task) → key limits → routing → engine, and ends with one usage row and
its metrics, whatever happened (its `Call`, api.calls); the steps after the
body are api.pipeline's, which the WebSocket chat runs too. Streams hold their key's
concurrency slot and their engine connection until the last byte; a caller that
hangs up cancels the request in the engine (Django cancels the response,
closing the connection), whenever it hangs up: before the answer, between the
headers and the first token, or mid-stream. A stream cut short records the
prompt's tokens and the completion's tokens already sent.

A database that is down fails no request that can do without it: a key this
process remembers keeps working, routed on the fleet as last read; what needs
the database (an unknown key, a fleet never read) is a 503 with Retry-After,
never a 500.
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from django import db
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel

from engines.client import EngineError
from routing.select import ModelRoute, Snapshot

from . import errors
from .answers import (
    embedding_answer,
    finish_reason,
    generation_answer,
    generation_fields,
)
from .calls import Call, Relay, after_answer
from .gateway import GATEWAY
from .models import ApiKey
from .openapi import openapi_document
from .pipeline import (
    admit,
    authenticate,
    database_failed,
    engine_failure,
    generation_open,
    model_route,
)
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse,
)
from .services import api_key_allows

# The answer's header naming how many of the oldest messages were dropped to fit
# the model's context.
DROPPED_HEADER = "X-Roundhouse-Dropped-Messages"

log = logging.getLogger("roundhouse.api")


async def _authenticated(request: HttpRequest) -> ApiKey:
    """The request's live key (api.pipeline.authenticate) from its header."""
    return await authenticate(
        authorization=request.headers.get("Authorization"),
        client=request.META.get("REMOTE_ADDR") or "unknown",
    )


def _method_not_allowed(request: HttpRequest, allowed: str) -> HttpResponse | None:
    if request.method == allowed:
        return None
    response = errors.method_not_allowed(allowed, request.path).response()
    response["Allow"] = allowed
    return response


async def _serve(
    request: HttpRequest,
    endpoint: str,
    schema: type[BaseModel],
    handler: Callable[[Call, Any, ModelRoute, Snapshot], Awaitable[HttpResponse]],
) -> HttpResponse:
    """The common pipeline; the handler talks to the engine and answers."""
    refused = _method_not_allowed(request, "POST")
    if refused is not None:
        return refused
    call = Call(endpoint)
    try:
        call.key = await _authenticated(request)
        # Its size was checked before it was read (roundhouse.asgi).
        payload = parse(schema, request.body)
        route, snapshot = await model_route(call, payload.model)
        await admit(call)
        response = await handler(call, payload, route, snapshot)
    except errors.ApiError as error:
        response = call.failed(error)
    except db.Error as error:  # the database failed (reading the fleet)
        response = call.failed(database_failed(error))
    except asyncio.CancelledError:  # the caller hung up before the answer
        call.hung_up()
        await asyncio.shield(call.end())
        raise
    except Exception:
        log.exception("%s failed", endpoint)
        internal = errors.engine_error("internal", "Internal error.")
        response = call.failed(internal)
    if isinstance(response, StreamingHttpResponse):
        # The stream ends the call when it ends, however it ends.
        response.streaming_content = Relay(response.streaming_content, call)
        return response
    await call.end()
    after_answer()
    return response


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


# -- generation ---------------------------------------------------------------


async def _generate(
    call: Call,
    payload: ChatCompletionRequest | CompletionRequest,
    route: ModelRoute,
    snapshot: Snapshot,
    *,
    chat: bool,
) -> HttpResponse:
    if not payload.stream:
        body, reply = await generation_answer(call, payload, route, snapshot, chat=chat)
        response = JsonResponse(body)
        _dropped_header(response, reply)
        return response

    fields = generation_fields(payload, "interactive")
    created = int(time.time())
    frames, start = await generation_open(call, route, snapshot, fields)
    base = {
        "id": ("chatcmpl-" if chat else "cmpl-") + start.get("request_id", ""),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": route.name,
        "system_fingerprint": None,
    }
    if payload.include_usage:
        base["usage"] = None

    def chunk(delta_or_text: dict | str, reason: str | None, **extra) -> bytes:
        if chat:
            choice = {"index": 0, "delta": delta_or_text, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_or_text, "logprobs": None}
        choice["finish_reason"] = reason
        return _sse({**base, "choices": [choice], **extra})

    async def content() -> AsyncIterator[bytes]:
        # Every write to the client is a send() that wakes it, which costs the
        # front 0.2-0.3 ms of CPU on a small VM: chunks due at the same moment
        # leave together. The response's headers tell the client that the engine
        # admitted the request; the role chunk waits for the first token (or the
        # end) and leaves in its write.
        pending = chunk({"role": "assistant", "content": ""}, None) if chat else b""
        try:
            async for frame in frames:
                if frame.get("event") == "token":
                    if call.first_token_at is None:
                        call.first_token_at = time.perf_counter()
                    # Counted as they come: a stream cut short (the caller gone,
                    # the engine dead or silent) gets no final usage.
                    call.completion_tokens += int(frame.get("tokens", 1))
                    text = frame.get("text", "")
                    yield pending + chunk({"content": text} if chat else text, None)
                    pending = b""
                elif frame.get("event") == "done":
                    call.counted(frame.get("usage", {}))
                    reason = finish_reason(frame.get("finish_reason", "stop"))
                    last = [
                        pending,
                        chunk({} if chat else "", reason, timings=call.timings(frame)),
                    ]
                    if payload.include_usage:
                        last.append(
                            _sse({**base, "choices": [], "usage": call.usage()})
                        )
                    last.append(_sse("[DONE]"))
                    yield b"".join(last)
        except EngineError as failure:
            # Headers are sent: the failure travels as an error event.
            error = engine_failure(failure)
            call.status, call.error_code = error.status, error.code or ""
            yield pending + _sse(error.body())
        finally:
            # Hanging up on the engine cancels the request there.
            await frames.aclose()

    response = StreamingHttpResponse(content(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must not hold tokens back
    _dropped_header(response, start)
    return response


def _dropped_header(response: HttpResponse, frame: dict) -> None:
    """How many of the oldest messages the engine dropped to fit the model's
    context (its context overflow setting allows it): the answer's header."""
    dropped = int(frame.get("dropped_messages") or 0)
    if dropped:
        response[DROPPED_HEADER] = str(dropped)


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/chat/completions."""

    async def handle(call, payload, route, snapshot):
        return await _generate(call, payload, route, snapshot, chat=True)

    return await _serve(request, "chat.completions", ChatCompletionRequest, handle)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/completions."""

    async def handle(call, payload, route, snapshot):
        return await _generate(call, payload, route, snapshot, chat=False)

    return await _serve(request, "completions", CompletionRequest, handle)


# -- embeddings -----------------------------------------------------------------


async def _embed(
    call: Call, payload: EmbeddingRequest, route: ModelRoute, snapshot: Snapshot
) -> HttpResponse:
    return JsonResponse(await embedding_answer(call, payload, route, snapshot))


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse:
    """POST /v1/embeddings."""
    return await _serve(request, "embeddings", EmbeddingRequest, _embed)


# -- models, OpenAPI ----------------------------------------------------------------


async def models(request: HttpRequest) -> HttpResponse:
    """GET /v1/models: every enabled model the key may use, each once."""
    refused = _method_not_allowed(request, "GET")
    if refused is not None:
        return refused
    try:
        key = await _authenticated(request)
        snapshot = await GATEWAY.snapshot()
    except errors.ApiError as error:
        return error.response()
    except db.Error as error:
        return database_failed(error).response()
    data = [
        {
            "id": name,
            "object": "model",
            "created": snapshot.models[name].created,
            "owned_by": "roundhouse",
        }
        for name in sorted(snapshot.models)
        if api_key_allows(key=key, model=name)
    ]
    after_answer()
    return JsonResponse({"object": "list", "data": data})


async def openapi(request: HttpRequest) -> HttpResponse:
    """GET /v1/openapi.json (built by api.openapi)."""
    refused = _method_not_allowed(request, "GET")
    if refused is not None:
        return refused
    return JsonResponse(openapi_document())


async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Unknown /v1/ paths answer in OpenAI's error shape, not Django's HTML."""
    return errors.from_mapping(
        errors.NOT_FOUND, f"Unknown endpoint {request.path}.", code="unknown_url"
    ).response()
