"""The OpenAI-compatible REST API, /healthz and /metrics.

Every API request goes: size cap → key → typed body → model (exists, allowed,
right task) → key limits → routing → engine, and ends with one usage row and
its metrics, whatever happened. Streams hold their key's concurrency slot and
their engine connection until the last byte; a caller that hangs up cancels the
request in the engine (Django cancels the response, closing the connection).
"""

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel

from engines.client import (
    EngineDied,
    EngineError,
    EngineRequestError,
    EngineTimeout,
    EngineUnreachable,
)
from fleet.selectors import engine_counters
from routing.select import ModelRoute, NoEngine, Snapshot

from . import errors, metrics, services
from .exceptions import KeyRejected, LimitExceeded
from .gateway import GATEWAY
from .limits import key_admission
from .models import ApiKey
from .schemas import (
    ENDPOINT_SCHEMAS,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse,
)
from .selectors import in_db_thread
from .services import api_key_allows, api_key_authenticate, usage_enqueue

log = logging.getLogger("roundhouse.api")

# Which endpoint may use a model of which task.
ENDPOINT_TASKS = {
    "chat.completions": ("chat",),
    "completions": ("chat", "completion"),
    "embeddings": ("embedding",),
}
# An engine that cannot be reached is skipped and the next choice tried, this
# many times at most.
MAX_ENGINE_TRIES = 3


@dataclass
class Call:
    """One API request's bookkeeping: becomes its usage row and metrics."""

    endpoint: str
    key: ApiKey | None = None
    model: str = ""
    engine: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 200
    error_code: str = ""
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def failed(self, error: errors.ApiError) -> HttpResponse:
        self.status, self.error_code = error.status, error.code or error.type
        return error.response()

    def finish(self) -> None:
        """Count the request and queue its usage row (never raises)."""
        latency = time.perf_counter() - self.started
        model = self.model or "-"
        metrics.REQUESTS.labels(
            self.endpoint, model, self.engine or "-", str(self.status)
        ).inc()
        metrics.LATENCY.labels(self.endpoint, model).observe(latency)
        if self.first_token_at is not None:
            metrics.TIME_TO_FIRST_TOKEN.labels(model).observe(
                self.first_token_at - self.started
            )
        for kind, count in (
            ("prompt", self.prompt_tokens),
            ("completion", self.completion_tokens),
        ):
            if count:
                metrics.TOKENS.labels(model, self.engine or "-", kind).inc(count)
        if self.key is None:
            return  # refused before a key was known: metrics only
        try:
            usage_enqueue(
                key=self.key,
                model=self.model,
                engine=self.engine,
                endpoint=self.endpoint,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                latency_ms=round(latency * 1000, 3),
                status=self.status,
                error_code=self.error_code,
            )
        except Exception:  # the answer is already sent; keep serving
            log.exception("could not record usage")


async def _admitted_model(
    call: Call, request: HttpRequest, schema: type[BaseModel]
) -> tuple[Any, ModelRoute, Snapshot]:
    """Authenticate, validate and find the model; ApiError otherwise."""
    try:
        call.key = await api_key_authenticate(
            authorization=request.headers.get("Authorization")
        )
    except KeyRejected as rejected:
        raise errors.unauthorized(rejected.message) from None
    # Its size was checked before it was read (roundhouse.asgi.BareASGIHandler).
    payload = parse(schema, request.body)
    call.model = payload.model
    snapshot = await GATEWAY.snapshot()
    if payload.model not in snapshot.models:  # maybe added since: look again
        snapshot = await GATEWAY.snapshot(fresh=True)
    route = snapshot.models.get(payload.model)
    if route is None or not api_key_allows(key=call.key, model=payload.model):
        raise errors.model_not_found(payload.model)
    task = route.task
    if task not in ENDPOINT_TASKS[call.endpoint]:
        raise errors.ApiError(
            400,
            f"The model '{payload.model}' is a {task or 'unknown'} model and cannot "
            f"serve /v1/{call.endpoint.replace('.', '/')}.",
            param="model",
            code="model_task_mismatch",
        )
    return payload, route, snapshot


async def _with_engine(
    call: Call,
    route: ModelRoute,
    snapshot: Snapshot,
    attempt: Callable[[Any], Awaitable[Any]],
) -> Any:
    """Run `attempt(client)` on the routed engine; an engine that cannot be
    reached is skipped for the next choice. Engine failures become ApiErrors."""
    tried: set[str] = set()
    while True:
        try:
            choice = GATEWAY.choose(route, snapshot, excluding=tried)
        except NoEngine as none:
            raise errors.from_mapping(
                errors.NO_ENGINE, none.message, code="no_engine"
            ) from None
        call.engine = choice.engine
        try:
            return await attempt(GATEWAY.client(choice.engine))
        except EngineUnreachable as error:
            log.warning("engine %s unreachable: %s", choice.engine, error)
            tried.add(choice.engine)
            GATEWAY.cache.invalidate()
            if len(tried) >= MAX_ENGINE_TRIES:
                raise errors.from_mapping(
                    errors.NO_ENGINE, str(error), code="engine_unreachable"
                ) from None
        except EngineRequestError as error:
            raise errors.engine_error(error.code, error.message) from None
        except EngineDied as error:
            raise errors.from_mapping(
                errors.ENGINE_DIED,
                f"The engine serving this model failed mid-request: {error}",
                code="engine_died",
            ) from None
        except EngineTimeout as error:
            raise errors.from_mapping(
                errors.ENGINE_TIMEOUT, str(error), code="engine_timeout"
            ) from None


def _method_not_allowed(request: HttpRequest, allowed: str) -> HttpResponse | None:
    if request.method == allowed:
        return None
    response = errors.ApiError(
        405, f"Use {allowed} for {request.path}.", code="method_not_allowed"
    ).response()
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
    limits = contextlib.AsyncExitStack()
    try:
        payload, route, snapshot = await _admitted_model(call, request, schema)
        try:
            await limits.enter_async_context(key_admission(call.key))
        except LimitExceeded as over:
            raise errors.rate_limited(over.message, over.retry_after_s) from None
        response = await handler(call, payload, route, snapshot)
    except errors.ApiError as error:
        response = call.failed(error)
    except asyncio.CancelledError:  # the caller hung up before the answer
        await asyncio.shield(limits.aclose())
        call.status, call.error_code = 499, "client_closed"
        call.finish()
        raise
    except Exception:
        log.exception("%s failed", endpoint)
        internal = errors.engine_error("internal", "Internal error.")
        response = call.failed(internal)
    if isinstance(response, StreamingHttpResponse):
        # The stream closes `limits` and finishes `call` when it ends.
        response.streaming_content = _closing(response.streaming_content, limits, call)
        return response
    await limits.aclose()
    call.finish()
    _after_answer()
    return response


# How long after a stream's first token its background refreshes start.
AFTER_FIRST_TOKEN_S = 0.1
# Background work started after a request reached its engine; referenced here
# until done (the event loop keeps only weak references to tasks).
_background: set[asyncio.Task] = set()


def _after_answer() -> None:
    """Refresh what requests read from memory (the fleet snapshot, stale keys)
    in the background, once this request's answer has started: that work then
    does not delay it."""
    GATEWAY.refresh_later()
    if services.stale_keys_waiting():
        task = asyncio.ensure_future(services.api_keys_revalidate())
        _background.add(task)
        task.add_done_callback(_background.discard)


async def _closing(
    content: AsyncIterator[bytes], limits: contextlib.AsyncExitStack, call: Call
) -> AsyncIterator[bytes]:
    # The background refreshes start a moment after the first token: not while
    # the engine computes the prompt (on a host whose cores the engine fills,
    # work done then delays the first token), nor with it: streams that started
    # together get their first tokens together, and a refresh started by the
    # first of them would hold the GIL while the front relays the others.
    refreshed = False
    try:
        async for chunk in content:
            yield chunk
            if not refreshed and call.first_token_at is not None:
                refreshed = True
                asyncio.get_running_loop().call_later(
                    AFTER_FIRST_TOKEN_S, _after_answer
                )
    except asyncio.CancelledError:
        call.status, call.error_code = 499, "client_closed"
        raise
    finally:
        if not refreshed:
            _after_answer()
        await asyncio.shield(limits.aclose())
        call.finish()


def _usage(call: Call) -> dict[str, int]:
    return {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": call.completion_tokens,
        "total_tokens": call.prompt_tokens + call.completion_tokens,
    }


def _timings(call: Call, reply: dict) -> dict:
    """Which engine answered, and its own times from the request's arrival
    (Roundhouse's addition to OpenAI's shape, like llama.cpp server's
    `timings`): what the front and the network add is the rest."""
    measured = reply.get("timings") or {}
    return {
        "engine": call.engine,
        "engine_first_token_ms": measured.get("first_token_ms"),
        "engine_total_ms": measured.get("total_ms"),
    }


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


# -- generation ---------------------------------------------------------------


async def _generate(
    call: Call,
    payload: ChatCompletionRequest | CompletionRequest,
    route: ModelRoute,
    snapshot: Snapshot,
    *,
    chat: bool,
) -> HttpResponse:
    fields = payload.engine_fields()
    # Our own id: unique across engines and their restarts (engine ids are not).
    fields["request_id"] = uuid.uuid4().hex
    created = int(time.time())
    if not payload.stream:
        reply = await _with_engine(
            call,
            route,
            snapshot,
            lambda client: client.generate(route.name, **fields),
        )
        usage = reply.get("usage", {})
        call.prompt_tokens = int(usage.get("prompt_tokens", 0))
        call.completion_tokens = int(usage.get("completion_tokens", 0))
        reason = _finish_reason(reply.get("finish_reason", "stop"))
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": reply.get("text", "")},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {
                "index": 0,
                "text": reply.get("text", ""),
                "logprobs": None,
                "finish_reason": reason,
            }
        return JsonResponse(
            {
                "id": ("chatcmpl-" if chat else "cmpl-") + reply["request_id"],
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": route.name,
                "system_fingerprint": None,
                "choices": [choice],
                "usage": _usage(call),
                "timings": _timings(call, reply),
            }
        )

    async def open_stream(client):
        frames = client.generate_stream(route.name, **fields)
        try:
            start = await anext(frames)  # admission errors surface here, as statuses
        except BaseException:
            await frames.aclose()
            raise
        return frames, start

    frames, start = await _with_engine(call, route, snapshot, open_stream)
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
                    text = frame.get("text", "")
                    yield pending + chunk({"content": text} if chat else text, None)
                    pending = b""
                elif frame.get("event") == "done":
                    usage = frame.get("usage", {})
                    call.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    call.completion_tokens = int(usage.get("completion_tokens", 0))
                    reason = _finish_reason(frame.get("finish_reason", "stop"))
                    last = [
                        pending,
                        chunk(
                            {} if chat else "", reason, timings=_timings(call, frame)
                        ),
                    ]
                    if payload.include_usage:
                        last.append(
                            _sse({**base, "choices": [], "usage": _usage(call)})
                        )
                    last.append(_sse("[DONE]"))
                    yield b"".join(last)
        except EngineError as failure:
            # Headers are sent: the failure travels as an error event.
            if isinstance(failure, EngineRequestError):
                error = errors.engine_error(failure.code, failure.message)
            else:
                error = errors.from_mapping(
                    errors.ENGINE_DIED, str(failure), code="engine_died"
                )
            call.status, call.error_code = error.status, error.code or ""
            yield pending + _sse(error.body())
        finally:
            # Hanging up on the engine cancels the request there.
            await frames.aclose()

    response = StreamingHttpResponse(content(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must not hold tokens back
    return response


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
    texts = payload.texts()
    rows, prompt_tokens = await _with_engine(
        call,
        route,
        snapshot,
        lambda client: client.embed_counted(route.name, texts),
    )
    if payload.dimensions is not None and payload.dimensions != rows.shape[1]:
        raise errors.ApiError(
            400,
            f"The model '{route.name}' returns {rows.shape[1]} dimensions; "
            f"{payload.dimensions} were asked for.",
            param="dimensions",
        )
    call.prompt_tokens = prompt_tokens
    if payload.encoding_format == "base64":
        vectors = [
            base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode()
            for row in rows
        ]
    else:
        vectors = rows.astype(float).tolist()
    return JsonResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": index, "embedding": vector}
                for index, vector in enumerate(vectors)
            ],
            "model": route.name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse:
    """POST /v1/embeddings."""
    return await _serve(request, "embeddings", EmbeddingRequest, _embed)


# -- models, health, metrics, OpenAPI ---------------------------------------------


async def models(request: HttpRequest) -> HttpResponse:
    """GET /v1/models: every enabled model the key may use, each once."""
    refused = _method_not_allowed(request, "GET")
    if refused is not None:
        return refused
    try:
        key = await api_key_authenticate(
            authorization=request.headers.get("Authorization")
        )
    except KeyRejected as rejected:
        return errors.unauthorized(rejected.message).response()
    snapshot = await GATEWAY.snapshot()
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
    _after_answer()
    return JsonResponse({"object": "list", "data": data})


async def healthz(request: HttpRequest) -> HttpResponse:
    """GET /healthz: the front answers; each engine's readiness. No secrets."""
    snapshot = await GATEWAY.snapshot()
    engines = {
        name: {
            "ready": engine.up,
            "cooling": engine.cooling,
            "resident_models": sorted(engine.resident),
        }
        for name, engine in snapshot.engines.items()
        if engine.enabled
    }
    ready = any(engine["ready"] for engine in engines.values())
    GATEWAY.refresh_later()
    return JsonResponse(
        {"status": "ok", "engines_ready": ready, "engines": engines},
        status=200,
    )


_engine_counters = in_db_thread(engine_counters)


async def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics in Prometheus' text format."""
    metrics.FLEET.snapshot = await GATEWAY.snapshot()
    restarts, model_queues = await _engine_counters()
    metrics.FLEET.restarts, metrics.FLEET.model_queues = restarts, model_queues
    return HttpResponse(
        metrics.exposition(), content_type="text/plain; version=0.0.4; charset=utf-8"
    )


def openapi_document() -> dict:
    """The OpenAPI 3.1 document of the endpoints, from the same schemas."""
    components: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for route, schema in ENDPOINT_SCHEMAS.items():
        document = schema.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(document.pop("$defs", {}))
        components[schema.__name__] = document
        paths[route] = {
            "post": {
                "operationId": route.strip("/").replace("/", "_"),
                "security": [{"bearer": []}],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "$ref": f"#/components/schemas/{schema.__name__}"
                            }
                        }
                    },
                },
                "responses": {
                    "200": {"description": "The result (JSON, or SSE when stream)."},
                    **{
                        str(status): {"$ref": "#/components/responses/Error"}
                        for status in (400, 401, 404, 413, 429, 502, 503)
                    },
                },
            }
        }
    paths["/v1/models"] = {
        "get": {
            "operationId": "v1_models",
            "security": [{"bearer": []}],
            "responses": {"200": {"description": "The models this key may use."}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Roundhouse OpenAI-compatible API", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "Error": {
                    "description": "An OpenAI-shaped error object.",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "error": {
                                        "type": "object",
                                        "properties": {
                                            "message": {"type": "string"},
                                            "type": {"type": "string"},
                                            "param": {"type": ["string", "null"]},
                                            "code": {"type": ["string", "null"]},
                                        },
                                    }
                                },
                            }
                        }
                    },
                }
            },
        },
    }


async def openapi(request: HttpRequest) -> HttpResponse:
    """GET /v1/openapi.json."""
    return JsonResponse(openapi_document())


async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Unknown /v1/ paths answer in OpenAI's error shape, not Django's HTML."""
    return errors.ApiError(
        404, f"Unknown endpoint {request.path}.", code="unknown_url"
    ).response()
