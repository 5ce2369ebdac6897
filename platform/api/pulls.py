"""Managing models over the API, for scripts and CI: pull a model into the
catalog and follow it (POST and GET /v1/pulls, GET and DELETE
/v1/pulls/{pull_id}, GET /v1/pulls/{pull_id}/events as Server-Sent Events),
and delete one (DELETE /v1/models/{name}).

Only a key that manages models (ApiKey.manages_models) may: any other key
gets 403, a missing or bad one 401 as elsewhere. What changes something is
admitted in the key's limits; reads are not, so that following a pull never
uses up a key's requests. Starting a pull reads the Hub (the source, its
files, the GGUF header) and deleting a model removes files: both run in a
thread of their own, never on the event loop nor in the thread the front's
database reads share (api.selectors.in_db_thread), which a slow Hub would
hold up. The pull itself runs in a worker (catalog.pull_jobs); on a cluster,
one that names no node runs where the model's first replica is placed
(fleet.pull_node). A pull whose Hub has stalled reads as such: its rate 0,
its time left unknown, its message "no bytes for 7 s" (catalog.pull_progress,
by the database's clock)."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ParamSpec, TypeVar

from django import db
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from catalog.hub import HubError
from catalog.models import ModelConfig, ModelPull, PullStatus
from catalog.pull_jobs import pull_cancel, pull_start
from catalog.pull_progress import pulls_with_db_now, rate_now, stalled_s, stalled_text
from cluster.models import Node
from fleet.model_removal import ModelInUse, model_delete
from fleet.pull_node import pull_node_default

from . import bodies, errors
from .models import ApiKey
from .pipeline import database_failed, keyed_request
from .pull_schemas import PullRequest
from .schemas import parse
from .selectors import in_db_thread
from .services import api_key_allows
from .sse import sse

log = logging.getLogger("roundhouse.api")

P = ParamSpec("P")
R = TypeVar("R")

# A pull's stream reads its row this often, and says something (an SSE
# comment) at least this often, so that proxies keep a quiet stream open.
POLL_S = 0.5
KEEPALIVE_S = 15.0
DEFAULT_PAGE = 20
MAX_PAGE = 100
# A pull in one of these has ended: its stream ends after saying so.
FINISHED = frozenset({PullStatus.DONE, PullStatus.FAILED, PullStatus.CANCELLED})

Handler = Callable[[HttpRequest, ApiKey], Awaitable[HttpResponse]]


def off_loop(function: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """`function` as a coroutine run in a thread of its own (blocking work:
    the Hub, files), which closes its database connections when done."""

    def closing(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        finally:
            db.connections.close_all()

    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(closing, *args, **kwargs)

    return run


async def _managed(request: HttpRequest, handlers: dict[str, Handler]) -> HttpResponse:
    """The pipeline's way in for resources, for a key that manages models
    (401 without a live key, 403 for one that may not)."""
    return await keyed_request(request, handlers, check=_manages_models)


def _manages_models(key: ApiKey) -> None:
    if not key.manages_models:
        raise errors.models_not_managed()


# -- reads ----------------------------------------------------------------------------


def _unix(moment) -> int | None:
    return None if moment is None else int(moment.timestamp())


def pull_body(pull: ModelPull) -> bodies.ModelPull:
    """The API's body of a pull (its model read with it: select_related;
    the database's clock too: pulls_with_db_now): while it has stalled, its
    rate is 0, its time left unknown, and its message says for how long."""
    rate, left = rate_now(pull)
    quiet = stalled_s(pull)
    message = pull.message
    if quiet is not None:
        message = "; ".join(filter(None, [stalled_text(quiet), message]))
    return bodies.ModelPull(
        id=pull.pk,
        source=pull.source,
        name=pull.name,
        node=pull.node,
        node_reason=pull.node_reason,
        status=pull.status,
        size_bytes=max(0, pull.size_bytes),
        done_bytes=max(0, pull.done_bytes),
        rate_bytes_per_s=max(0.0, rate),
        seconds_left=None if left is None else max(0.0, left),
        message=message,
        model=pull.model.name if pull.model is not None else None,
        created_at=_unix(pull.created_at),
        finished_at=_unix(pull.finished_at),
    )


def pull_read(*, pull_id: int) -> bodies.ModelPull | None:
    """The pull's body, or None when there is no such pull."""
    pull = pulls_with_db_now().select_related("model").filter(pk=pull_id).first()
    return None if pull is None else pull_body(pull)


def pull_page(*, after: int | None, limit: int) -> bodies.ModelPullList:
    """Up to `limit` pulls older than `after` (None: the newest), newest first."""
    rows = pulls_with_db_now().select_related("model").order_by("-pk")
    if after is not None:
        rows = rows.filter(pk__lt=after)
    found = list(rows[: limit + 1])
    data = [pull_body(pull) for pull in found[:limit]]
    return bodies.ModelPullList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(found) > limit,
    )


pull_get = in_db_thread(pull_read)


def _pull_id(raw: str) -> int:
    """The path's pull id; 404 for one that cannot be a pull's."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise errors.pull_not_found(raw)
    return int(raw)


async def _pull(raw_id: str) -> bodies.ModelPull:
    found = await pull_get(pull_id=_pull_id(raw_id))
    if found is None:
        raise errors.pull_not_found(raw_id)
    return found


def _query_int(request: HttpRequest, name: str, low: int, high: int) -> int | None:
    """A whole-number query parameter from `low` to `high`; None when absent."""
    raw = request.GET.get(name)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise errors.invalid_request(
            f"{name} must be a whole number from {low} to {high}.", param=name
        )
    return int(raw)


def _json(body: bodies.Body, status: int = 200) -> JsonResponse:
    return JsonResponse(body.model_dump(mode="json"), status=status)


# -- writes ---------------------------------------------------------------------------


def pull_begin(*, key: ApiKey, payload: PullRequest) -> bodies.ModelPull:
    """Start the pull (catalog.pull_jobs.pull_start: the source read before a
    byte of weights) on its node, or with none on a cluster where the model's
    first replica is placed (fleet.pull_node); ApiError for a node that does
    not exist, and for what the Hub refused, with its status and reason.
    Blocking."""
    if payload.node and not Node.objects.filter(name=payload.node).exists():
        raise errors.invalid_request(
            f"No node is named {payload.node!r}.", param="node"
        )
    try:
        pull = pull_start(
            source=payload.source,
            name=payload.name,
            revision=payload.revision,
            sha256=payload.sha256,
            node=payload.node,
            node_default=pull_node_default,
            user=key.owner,
        )
    except HubError as refused:
        raise errors.hub_refused(refused.status, refused.message) from None
    log.info("pull %s of %s started by API key %s", pull.pk, pull.source, key.pk)
    return pull_read(pull_id=pull.pk)


def pull_stop(*, pull_id: int) -> bodies.ModelPull | None:
    """Cancel the pull (catalog.pull_jobs.pull_cancel); its body after, None
    when there is no such pull."""
    pull = ModelPull.objects.filter(pk=pull_id).first()
    if pull is None:
        return None
    pull_cancel(pull=pull)
    return pull_read(pull_id=pull_id)


def model_remove(*, key: ApiKey, name: str) -> bodies.ModelDeleted:
    """Delete the model (fleet.model_removal: its files on this host, then its
    row); 404 for a model the key cannot see, 409 with the reason while it
    is loaded or placed anywhere. Blocking."""
    model = ModelConfig.objects.filter(name=name).first()
    if model is None or not api_key_allows(key=key, model=name):
        raise errors.model_not_found(name)
    try:
        freed = model_delete(model=model)
    except ModelInUse as busy:
        raise errors.model_in_use(str(busy)) from None
    log.info("model %s deleted by API key %s (%d bytes freed)", name, key.pk, freed)
    return bodies.ModelDeleted(id=name, bytes_freed=freed)


# -- the stream -----------------------------------------------------------------------


async def pull_events(first: bodies.ModelPull) -> AsyncIterator[bytes]:
    """The pull now, then again each time it changes (its row read every
    POLL_S), until it has ended; a comment every KEEPALIVE_S while nothing
    changes. A caller that hangs up cancels it (the front cancels the
    answer). The database failing ends it with an error event."""
    loop = asyncio.get_running_loop()
    last = first
    said_at = loop.time()
    yield sse(first)
    while last.status not in FINISHED:
        await asyncio.sleep(POLL_S)
        try:
            now = await pull_get(pull_id=first.id)
        except db.Error as error:
            yield sse(database_failed(error).body())
            return
        if now is None:  # the pull's row was deleted (in the admin)
            yield sse(errors.pull_not_found(str(first.id)).body())
            return
        if now != last:
            last, said_at = now, loop.time()
            yield sse(now)
        elif loop.time() - said_at >= KEEPALIVE_S:
            said_at = loop.time()
            yield b": still " + now.status.encode() + b"\n\n"


def _stream(first: bodies.ModelPull) -> StreamingHttpResponse:
    response = StreamingHttpResponse(
        pull_events(first), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must not hold events back
    return response


# -- views ----------------------------------------------------------------------------


async def _create(request: HttpRequest, key: ApiKey) -> HttpResponse:
    # Its size was checked before it was read (roundhouse.asgi).
    payload = parse(PullRequest, request.body)
    started = await off_loop(pull_begin)(key=key, payload=payload)
    return _json(started, status=202)


async def _list(request: HttpRequest, key: ApiKey) -> HttpResponse:
    limit = _query_int(request, "limit", 1, MAX_PAGE) or DEFAULT_PAGE
    after = _query_int(request, "after", 1, 2**63 - 1)
    page = await in_db_thread(pull_page)(after=after, limit=limit)
    return _json(page)


@csrf_exempt
async def pulls(request: HttpRequest) -> HttpResponse:
    """POST /v1/pulls (202: queued); GET /v1/pulls (?limit=&after=)."""
    return await _managed(request, {"POST": _create, "GET": _list})


@csrf_exempt
async def pull(request: HttpRequest, pull_id: str) -> HttpResponse:
    """GET and DELETE (cancel) /v1/pulls/{pull_id}."""

    async def get(request, key):
        return _json(await _pull(pull_id))

    async def delete(request, key):
        stopped = await in_db_thread(pull_stop)(pull_id=_pull_id(pull_id))
        if stopped is None:
            raise errors.pull_not_found(pull_id)
        return _json(stopped)

    return await _managed(request, {"GET": get, "DELETE": delete})


@csrf_exempt
async def pull_stream(request: HttpRequest, pull_id: str) -> HttpResponse:
    """GET /v1/pulls/{pull_id}/events: the pull as Server-Sent Events."""

    async def get(request, key):
        return _stream(await _pull(pull_id))

    return await _managed(request, {"GET": get})


@csrf_exempt
async def model(request: HttpRequest, name: str) -> HttpResponse:
    """DELETE /v1/models/{name}."""

    async def delete(request, key):
        return _json(await off_loop(model_remove)(key=key, name=name))

    return await _managed(request, {"DELETE": delete})
