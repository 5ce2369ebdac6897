"""The OpenAI-compatible REST API, /healthz and /metrics.

Every API request goes: size cap → key → typed body → model (exists, allowed,
right task) → key limits → routing → engine, and ends with one usage row and
its metrics, whatever happened. Streams hold their key's concurrency slot and
their engine connection until the last byte; a caller that hangs up cancels the
request in the engine (Django cancels the response, closing the connection),
whenever it hangs up: before the answer, between the headers and the first
token, or mid-stream. A stream cut short records the tokens already sent.
"""

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel

from engines.client import (
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
from .openapi import openapi_document
from .schemas import (
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
    # What the request holds until it ends: its key's concurrency slot, its
    # engine stream.
    held: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    ended: bool = False

    def failed(self, error: errors.ApiError) -> HttpResponse:
        self.status, self.error_code = error.status, error.code or error.type
        return error.response()

    def hung_up(self) -> None:
        """The caller went away (an error already recorded stays)."""
        if self.status < 400:
            self.status, self.error_code = 499, "client_closed"

    async def end(self) -> None:
        """Release what the request holds, then `finish` it; once."""
        if self.ended:
            return
        self.ended = True
        try:
            await self.held.aclose()
        finally:
            self.finish()

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


async def _authenticated(request: HttpRequest) -> ApiKey:
    """The request's live key; ApiError (401, or 429 for a client over its
    failed keys) otherwise."""
    try:
        return await api_key_authenticate(
            authorization=request.headers.get("Authorization"),
            # Behind a proxy every caller has the proxy's address, and shares
            # its throttle.
            client=request.META.get("REMOTE_ADDR") or "unknown",
        )
    except KeyRejected as rejected:
        raise errors.unauthorized(rejected.message) from None
    except LimitExceeded as over:
        raise errors.rate_limited(
            over.message, over.retry_after_s, code=over.code
        ) from None


async def _admitted_model(
    call: Call, request: HttpRequest, schema: type[BaseModel]
) -> tuple[Any, ModelRoute, Snapshot]:
    """Authenticate, validate and find the model; ApiError otherwise."""
    call.key = await _authenticated(request)
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
        raise errors.invalid_request(
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
        except EngineError as error:
            raise _engine_failure(error) from None


def _engine_failure(error: EngineError) -> errors.ApiError:
    """The API error for an engine that failed once it had the request."""
    if isinstance(error, EngineRequestError):
        return errors.engine_error(error.code, error.message)
    if isinstance(error, EngineTimeout):
        return errors.from_mapping(
            errors.ENGINE_TIMEOUT, str(error), code="engine_timeout"
        )
    return errors.from_mapping(
        errors.ENGINE_DIED,
        f"The engine serving this model failed mid-request: {error}",
        code="engine_died",
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
        payload, route, snapshot = await _admitted_model(call, request, schema)
        try:
            await call.held.enter_async_context(key_admission(call.key))
        except LimitExceeded as over:
            raise errors.rate_limited(
                over.message, over.retry_after_s, code=over.code
            ) from None
        response = await handler(call, payload, route, snapshot)
    except errors.ApiError as error:
        response = call.failed(error)
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
        response.streaming_content = _Relay(response.streaming_content, call)
        return response
    await call.end()
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


class _Relay:
    """A stream's body: relays its chunks, and ends its call (gives back the
    key's slot, hangs up on the engine, records usage) however the stream ends:
    its last chunk, an engine failure, the caller hanging up mid-stream, or the
    response closed before its body was read (the caller hung up between the
    headers and the first token, while the headers were being sent). Django
    closes a response whatever became of it, and calls `close` on its body."""

    def __init__(self, content: AsyncGenerator[bytes, None], call: Call) -> None:
        self._content = content
        self._call = call
        self._loop = asyncio.get_running_loop()
        self._chunks = self._relay()

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        return self._chunks

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        # The background refreshes start a moment after the first token: not
        # while the engine computes the prompt (on a host whose cores the engine
        # fills, work done then delays the first token), nor with it: streams
        # that started together get their first tokens together, and a refresh
        # started by the first of them would hold the GIL while the front
        # relays the others.
        refreshed = False
        try:
            async for chunk in self._content:
                yield chunk
                if not refreshed and self._call.first_token_at is not None:
                    refreshed = True
                    self._loop.call_later(AFTER_FIRST_TOKEN_S, _after_answer)
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled while waiting for the engine, or closed while a chunk
            # was being sent: the caller went away.
            self._call.hung_up()
            raise
        finally:
            if not refreshed:
                _after_answer()
            try:
                await self._content.aclose()  # left at a chunk: its engine too
            finally:
                await asyncio.shield(self._call.end())

    def close(self) -> None:
        """Django is done with the response: end a stream that did not end
        (maybe from another thread)."""
        if not self._call.ended:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                self._loop.call_soon_threadsafe(self._abandoned)

    def _abandoned(self) -> None:
        task = self._loop.create_task(self._end_abandoned())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _end_abandoned(self) -> None:
        await self._chunks.aclose()  # if it started, its `finally` ends the call
        if not self._call.ended:  # it never started
            self._call.hung_up()
            await self._call.end()


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
    # Closed when the call ends, also if the stream's body never starts.
    call.held.push_async_callback(frames.aclose)
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
            error = _engine_failure(failure)
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
        raise errors.invalid_request(
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
        key = await _authenticated(request)
    except errors.ApiError as error:
        return error.response()
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
