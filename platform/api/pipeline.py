"""The request pipeline that REST (api.views) and the WebSocket chat
(chat.consumers) share, free of either transport.

A request goes: caller (an API key from `authenticate`, or a logged-in user)
→ typed body (api.schemas) → `call_admitted`, the one way in for every
transport (REST, the WebSocket chat, batch lines): `model_route` (exists, the
key may use it, right task; the route and the fleet go on the call) and
`admit` (the caller's rate and concurrency limits, held until the call ends)
→ `with_engine` / `generation_open` (routing, failover to the next engine
when one cannot be reached) → its `Call` ends in one usage row and its
metrics. Any failure becomes the API's error in one place (`api_error`); the
transports only frame it: an HTTP answer, a WebSocket error message, a batch
line's error record.
"""

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from django import db
from django.http import HttpRequest, HttpResponse
from node_link.client import NodeUnreachable

from engines.wire.client import (
    EngineDied,
    EngineError,
    EngineRequestError,
    EngineTimeout,
    EngineUnreachable,
)
from engines.wire.errors import ErrorCode
from engines.wire.replies import StartFrame, StreamEvent
from engines.wire.requests import GenerateRequest
from routing.select import NoEngine

from . import errors
from .calls import Call
from .exceptions import KeyCheckUnavailable, KeyRejected, LimitExceeded
from .gateway import front_gateway
from .limits import Allowance, TooHeavy, admission
from .models import ApiKey
from .selectors import in_db_thread, user_allowance, user_allowance_remembered
from .services import DATABASE_OUTAGE, api_key_allows, api_key_authenticate

__all__ = [
    "ENDPOINT_TASKS",
    "admission_hold",
    "admit",
    "api_error",
    "authenticate",
    "call_admitted",
    "database_failed",
    "engine_failure",
    "generation_open",
    "model_route",
    "with_engine",
]

log = logging.getLogger("roundhouse.api")

# Which endpoint may use a model of which task.
ENDPOINT_TASKS = {
    "chat.completions": ("chat",),
    "completions": ("chat", "completion"),
    "embeddings": ("embedding",),
    "ws.chat": ("chat",),
    "responses": ("chat",),
    "messages": ("chat",),
    "messages.count_tokens": ("chat",),
    "ollama.chat": ("chat",),
    "ollama.generate": ("chat", "completion"),
    "ollama.embed": ("embedding",),
    # Cross-encoders, and embedding models by cosine similarity.
    "rerank": ("rerank", "embedding"),
    "tokenize": ("chat", "completion"),
    "detokenize": ("chat", "completion"),
}
# Where an endpoint's task mismatch sends the caller, in its error message.
_ENDPOINT_PATHS = {
    "ws.chat": "/ws/chat/",
    "ollama.chat": "/api/chat",
    "ollama.generate": "/api/generate",
    "ollama.embed": "/api/embed",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}
# An engine that cannot be reached (the request never reached it) is skipped
# and the next choice tried, this many engines at most. An engine that died
# with the request is not (with_engine).
MAX_ENGINE_TRIES = 3


async def authenticate(*, authorization: str | None, client: str) -> ApiKey:
    """The live key of an `Authorization: Bearer` value; ApiError (401, 429 for
    a client over its failed keys, 503 for a key that cannot be checked now)
    otherwise. `client` is the caller's address (behind a proxy every caller
    has the proxy's, and shares its throttle)."""
    try:
        return await api_key_authenticate(authorization=authorization, client=client)
    except KeyRejected as rejected:
        raise errors.unauthorized(rejected.message) from None
    except LimitExceeded as over:
        raise errors.rate_limited(
            over.message, over.retry_after_s, code=over.code
        ) from None
    except KeyCheckUnavailable as unavailable:
        raise errors.database_unavailable(unavailable.message) from None


def database_failed(error: db.Error) -> errors.ApiError:
    """The 503 for a request that needed the database while it failed."""
    DATABASE_OUTAGE.failed("serving an API request", error)
    return errors.database_unavailable(
        "The database is unavailable; try again shortly."
    )


def api_error(error: Exception, *, what: str) -> errors.ApiError:
    """Any failure of a request as the API's error, for every transport: a
    refusal as it is, the database failing as a 503, an engine's failure as
    its error, anything else logged (`what` failed) and answered as an
    internal error."""
    if isinstance(error, errors.ApiError):
        return error
    if isinstance(error, db.Error):
        return database_failed(error)
    if isinstance(error, EngineError):
        return engine_failure(error)
    log.error("%s failed", what, exc_info=error)
    return errors.engine_error(ErrorCode.INTERNAL, "Internal error.")


async def call_admitted(call: Call, model: str, *, weight: int = 1) -> None:
    """The one way in: the call's model routed (`model_route`) and the call
    admitted (`admit`); ApiError when either refuses."""
    await model_route(call, model)
    await admit(call, weight=weight)


async def model_route(call: Call, model: str) -> None:
    """Put on the call the model's route and the fleet snapshot to choose its
    engine from; ApiError for a model that does not exist, that the call's key
    may not use, or whose task the call's endpoint does not serve."""
    call.model = model
    gateway = front_gateway()
    snapshot = await gateway.snapshot()
    if model not in snapshot.models:  # maybe added since: look again
        snapshot = await gateway.snapshot(fresh=True)
    route = snapshot.models.get(model)
    if route is None or (
        call.key is not None and not api_key_allows(key=call.key, model=model)
    ):
        raise errors.model_not_found(model)
    call.share_prompt_cache = route.share_prompt_cache
    task = route.task
    if task not in ENDPOINT_TASKS[call.endpoint]:
        path = _ENDPOINT_PATHS.get(call.endpoint) or (
            f"/v1/{call.endpoint.replace('.', '/')}"
        )
        raise errors.invalid_request(
            f"The model '{model}' is a {task or 'unknown'} model and cannot "
            f"serve {path}.",
            param="model",
            code=errors.ApiCode.MODEL_TASK_MISMATCH,
        )
    call.route, call.snapshot = route, snapshot


async def admit(call: Call, *, weight: int = 1) -> None:
    """Take the caller's rate and concurrency allowance, held until the call
    ends: its key's (live requests and batch lines counted apart) or its
    logged-in user's. `weight` is the engine requests the call opens (n
    choices: n). 429 when over; 400 for a call heavier than the whole
    allowance; a call with neither key nor user is refused (nothing runs
    unmetered)."""
    if call.key is not None:
        allowance = (
            Allowance.of_key_batches(call.key)
            if call.batch
            else Allowance.of_key(call.key)
        )
    elif call.user is not None:
        allowance = user_allowance_remembered(
            user_id=call.user.pk
        ) or await in_db_thread(user_allowance)(user_id=call.user.pk)
    else:
        raise errors.unauthorized("No API key or logged-in user to admit.")
    call.caller = allowance.scope
    await admission_hold(call.held, allowance, weight=weight)


async def admission_hold(
    held: contextlib.AsyncExitStack, allowance: Allowance, *, weight: int = 1
) -> None:
    """Admit one request of `allowance` until `held` closes; its refusals as
    ApiErrors (429 over a limit, 400 heavier than the whole allowance)."""
    try:
        await held.enter_async_context(admission(allowance, weight=weight))
    except TooHeavy as heavy:
        raise errors.invalid_request(
            heavy.message, param="n", code=heavy.code
        ) from None
    except LimitExceeded as over:
        raise errors.rate_limited(
            over.message, over.retry_after_s, code=over.code
        ) from None


KeyedHandler = Callable[[HttpRequest, ApiKey], Awaitable[HttpResponse]]


async def keyed_request(
    request: HttpRequest,
    handlers: dict[str, KeyedHandler],
    *,
    check: Callable[[ApiKey], None] | None = None,
    refused: Callable[[errors.ApiError], HttpResponse] = errors.ApiError.response,
) -> HttpResponse:
    """The way in of an endpoint over resources (files, batches, pulls): the
    method's check, the API key (and `check` of it, which raises an ApiError
    for a key that may not), admission of anything but a GET, then the
    method's handler; any failure as the API's error, framed by `refused`."""
    handler = handlers.get(request.method or "")
    if handler is None:
        allowed = ", ".join(handlers)
        response = errors.method_not_allowed(allowed, request.path).response()
        response["Allow"] = allowed
        return response
    try:
        key = await authenticate(
            authorization=request.headers.get("Authorization"),
            client=request.META.get("REMOTE_ADDR") or "unknown",
        )
        if check is not None:
            check(key)
        async with contextlib.AsyncExitStack() as held:
            if request.method != "GET":
                await admission_hold(held, Allowance.of_key(key))
            return await handler(request, key)
    except Exception as error:
        return refused(api_error(error, what=f"{request.method} {request.path}"))


async def with_engine(call: Call, attempt: Callable[[Any], Awaitable[Any]]) -> Any:
    """Run `attempt(client)` on the call's engine, of this host or another
    node. Only a request that never reached an engine is sent to another: an
    engine that cannot be reached (nothing listens on its port, its node's
    relay could not reach it, no link to its node) is skipped for the next
    choice, up to MAX_ENGINE_TRIES engines. A request whose engine took it and
    then died (its connection dropped before the answer) is not: the request
    may be what killed it, and one poison input must not take down every
    replica in turn; the caller gets `engine_died`. Engine failures become
    ApiErrors."""
    route, snapshot = call.route, call.snapshot
    assert route is not None and snapshot is not None, "model_route first"
    gateway = front_gateway()
    tried: set[str] = set()
    unreachable: EngineUnreachable | None = None
    # The engine whose prompt cache holds the longest of the request's
    # prefixes, as any front remembers it (Redis: only where a model has
    # replicas to choose among), else as this one does.
    shared = route.replicas > 1
    affinity = await gateway.affinity.lookup(
        call.prefixes, snapshot.engines, shared=shared
    )
    while True:
        try:
            choice = gateway.choose(route, snapshot, excluding=tried, affinity=affinity)
        except NoEngine as none:
            # No other engine: the failure met, else why there is none.
            if unreachable is not None:
                raise errors.from_mapping(
                    errors.NO_ENGINE,
                    str(unreachable),
                    code=errors.ApiCode.ENGINE_UNREACHABLE,
                ) from None
            raise errors.from_mapping(
                errors.NO_ENGINE, none.message, code=errors.ApiCode.NO_ENGINE
            ) from None
        engine = call.engine = choice.engine
        call.node = gateway.node_of(engine, snapshot)
        gateway.request_sent(engine)
        try:
            result = await attempt(gateway.client(engine, snapshot))
        except EngineUnreachable as error:
            gateway.request_ended(engine)
            log.warning("engine %s could not be reached: %s", engine, error)
            if isinstance(error, NodeUnreachable):
                gateway.node_unreachable(error.node)  # its other engines too
            tried.add(engine)
            gateway.cache.invalidate()
            unreachable = error
            if len(tried) >= MAX_ENGINE_TRIES:
                raise errors.from_mapping(
                    errors.NO_ENGINE, str(error), code=errors.ApiCode.ENGINE_UNREACHABLE
                ) from None
            continue
        except EngineDied as error:
            gateway.request_ended(engine)
            log.warning(
                "engine %s failed while serving a request (not sent to another "
                "engine): %s",
                engine,
                error,
            )
            gateway.cache.invalidate()
            raise engine_failure(error) from None
        except BaseException as error:
            gateway.request_ended(engine)
            if isinstance(error, EngineError):
                raise engine_failure(error) from None
            raise
        call.held.callback(gateway.request_ended, engine)
        status = snapshot.engines.get(engine)
        if call.prefixes and status is not None:
            gateway.affinity.remember(call.prefixes, status, shared=shared)
        return result


def engine_failure(error: EngineError) -> errors.ApiError:
    """The API error for an engine that failed once it had the request."""
    if isinstance(error, EngineRequestError):
        return errors.engine_error(error.code, error.message)
    if isinstance(error, EngineTimeout):
        return errors.from_mapping(
            errors.ENGINE_TIMEOUT, str(error), code=errors.ApiCode.ENGINE_TIMEOUT
        )
    return errors.from_mapping(
        errors.ENGINE_DIED,
        "The engine serving this request failed while serving it (the request "
        f"was not sent to another engine): {error}",
        code=errors.ApiCode.ENGINE_DIED,
    )


async def generation_open(
    call: Call, request: GenerateRequest
) -> tuple[AsyncIterator[StreamEvent], StartFrame]:
    """Start a streamed generation on the routed engine: its frames and its
    start frame, which comes once a slot took the request (admission errors
    are raised here, before anything is sent to the caller). The call records
    the prompt's tokens (a stream cut short counts them too) and closes the
    frames when it ends; closing them hangs up on the engine, which cancels
    the request there."""

    async def open_stream(client):
        frames = client.generate_stream(request)
        try:
            start = await anext(frames)
        except BaseException:
            await frames.aclose()
            raise
        return frames, start

    frames, start = await with_engine(call, open_stream)
    call.held.push_async_callback(frames.aclose)
    return frames, start
