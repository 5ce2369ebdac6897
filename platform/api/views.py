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
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel

from . import bodies, errors
from .answers import embedding_answer, generation_answer
from .calls import Call, StreamBody, after_answer
from .gateway import front_gateway
from .models import ApiKey
from .openapi import openapi_document
from .pipeline import api_error, authenticate, call_admitted
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse,
)
from .services import api_key_allows
from .sse import dropped_header, generation_stream

log = logging.getLogger("roundhouse.api")

# Which engine, on which node, served an answer.
ENGINE_HEADER = "X-Roundhouse-Engine"
NODE_HEADER = "X-Roundhouse-Node"


def bearer(request: HttpRequest) -> str | None:
    """The request's `Authorization` header (OpenAI's `Bearer <key>`)."""
    return request.headers.get("Authorization")


async def authenticated_by(
    request: HttpRequest, authorization: Callable[[HttpRequest], str | None] = bearer
) -> ApiKey:
    """The request's live key (api.pipeline.authenticate) from its header."""
    return await authenticate(
        authorization=authorization(request),
        client=request.META.get("REMOTE_ADDR") or "unknown",
    )


def method_refused(
    request: HttpRequest,
    allowed: str,
    framed: Callable[[errors.ApiError], HttpResponse] | None = None,
) -> HttpResponse | None:
    """None for the allowed method; else the 405, framed as the dialect
    answers errors (`framed`: OpenAI's shape by default)."""
    if request.method == allowed:
        return None
    refusal = errors.method_not_allowed(allowed, request.path)
    response = framed(refusal) if framed is not None else refusal.response()
    response["Allow"] = allowed
    return response


async def serve(
    request: HttpRequest,
    endpoint: str,
    schema: type[BaseModel],
    handler: Callable[[Call, Any], Awaitable[HttpResponse]],
    *,
    prepare: Callable[[Call, Any], Awaitable[Any]] | None = None,
    caller: Callable[[HttpRequest], Awaitable[ApiKey]] | None = None,
    framed: Callable[[errors.ApiError], HttpResponse] | None = None,
) -> HttpResponse:
    """The pipeline's way in, then the handler, which talks to the engine and
    answers; any failure answered as the API's error. A dialect changes the
    edges only: `prepare` turns the checked body into what is admitted and
    handled (its translation onto a chat request, knowing the caller):
    anything with `model` and `weight`; `caller` finds the request's key
    (default: its `Authorization: Bearer` header); `framed` answers an error
    in the dialect's shape (default: OpenAI's)."""
    refused = method_refused(request, "POST", framed)
    if refused is not None:
        return refused
    call = Call(endpoint)
    try:
        call.authenticated(await (caller or authenticated_by)(request))
        # Its size was checked before it was read (roundhouse.asgi).
        payload = parse(schema, request.body)
        if prepare is not None:
            payload = await prepare(call, payload)
        await call_admitted(call, payload.model, weight=payload.weight)
        response = await handler(call, payload)
    except asyncio.CancelledError:  # the caller hung up before the answer
        call.hung_up()
        await asyncio.shield(call.end())
        raise
    except Exception as error:
        failure = api_error(error, what=endpoint)
        call.failed_with(failure)
        response = framed(failure) if framed is not None else failure.response()
    if call.engine:  # who served it (on a cluster, from any node's front)
        response[ENGINE_HEADER] = call.engine
        if call.node:
            response[NODE_HEADER] = call.node
    if isinstance(response, StreamingHttpResponse):
        # The stream ends the call when it ends, however it ends.
        response.streaming_content = StreamBody(response.streaming_content, call)
        return response
    await call.end()
    after_answer()
    return response


# -- generation ---------------------------------------------------------------


async def _generate(
    call: Call, payload: ChatCompletionRequest | CompletionRequest, *, chat: bool
) -> HttpResponse:
    if payload.stream:
        return await generation_stream(call, payload, chat=chat)
    body, reply = await generation_answer(call, payload, chat=chat)
    response = JsonResponse(body)
    dropped_header(response, reply)
    return response


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/chat/completions."""

    async def handle(call, payload):
        return await _generate(call, payload, chat=True)

    return await serve(request, "chat.completions", ChatCompletionRequest, handle)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/completions."""

    async def handle(call, payload):
        return await _generate(call, payload, chat=False)

    return await serve(request, "completions", CompletionRequest, handle)


# -- embeddings -----------------------------------------------------------------


async def _embed(call: Call, payload: EmbeddingRequest) -> HttpResponse:
    return JsonResponse(await embedding_answer(call, payload))


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse:
    """POST /v1/embeddings."""
    return await serve(request, "embeddings", EmbeddingRequest, _embed)


# -- models, OpenAPI ----------------------------------------------------------------


async def models(request: HttpRequest) -> HttpResponse:
    """GET /v1/models: every enabled model the key may use, each once."""
    refused = method_refused(request, "GET")
    if refused is not None:
        return refused
    try:
        key = await authenticated_by(request)
        snapshot = await front_gateway().snapshot()
    except Exception as error:
        return api_error(error, what="/v1/models").response()
    listed = bodies.ModelList(
        data=[
            bodies.Model(
                id=name, created=snapshot.models[name].created, owned_by="roundhouse"
            )
            for name in sorted(snapshot.models)
            if api_key_allows(key=key, model=name)
        ]
    )
    after_answer()
    return JsonResponse(listed.model_dump(mode="json"))


async def openapi(request: HttpRequest) -> HttpResponse:
    """GET /v1/openapi.json (built by api.openapi)."""
    refused = method_refused(request, "GET")
    if refused is not None:
        return refused
    return JsonResponse(openapi_document())


async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Unknown /v1/ paths answer in OpenAI's error shape, not Django's HTML."""
    return errors.from_mapping(
        errors.NOT_FOUND,
        f"Unknown endpoint {request.path}.",
        code=errors.ApiCode.UNKNOWN_URL,
    ).response()
