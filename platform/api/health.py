"""GET /healthz and GET /metrics: what the front, its engines and its database
are doing. No key needed, no secrets shown; a database that is down fails
neither (they show the fleet as last read)."""

from django import db
from django.http import HttpRequest, HttpResponse, JsonResponse

from fleet.selectors import engine_counters
from routing.select import Snapshot

from . import errors, limits, metrics
from .gateway import front_gateway, unconfirmed
from .selectors import in_db_thread
from .services import DATABASE_OUTAGE

_engine_counters = in_db_thread(engine_counters)
# /healthz waits this long at most for a view of the fleet under a second old
# (a database that hangs): then it answers from the last view, and says how old.
HEALTH_WAIT_S = 2.0


async def _fleet_or_last() -> Snapshot | None:
    """The fleet snapshot; while the database fails, the last one read (the
    gateway's), or None if this process never read one."""
    try:
        return await front_gateway().snapshot()
    except db.Error as error:
        DATABASE_OUTAGE.failed("reading the fleet", error)
        return None
    except errors.ApiError:  # a node cut off from its cluster: it shows nothing
        return None


async def healthz(request: HttpRequest) -> HttpResponse:
    """GET /healthz: the front answers; each engine's readiness from a view of
    the fleet under a second old (waiting up to HEALTH_WAIT_S for it); while
    the database does not answer, from the last view read. `view_age_s` says
    how old the view is. No secrets."""
    view = await front_gateway().view(wait_s=HEALTH_WAIT_S)
    snapshot, age_s = view if view is not None else (None, None)
    if snapshot is not None and unconfirmed(snapshot, age_s):
        snapshot = None  # a node cut off from its cluster: it shows nothing
    engines = {
        name: {
            "ready": engine.up,
            "node": engine.node,
            "cooling": engine.cooling,
            "resident_models": sorted(engine.resident),
        }
        for name, engine in (snapshot.engines.items() if snapshot else ())
        if engine.enabled
    }
    ready = any(engine["ready"] for engine in engines.values())
    body = {
        "status": "ok",
        "engines_ready": ready,
        "engines": engines,
        "view_age_s": None if age_s is None else round(age_s, 3),
        "limits": limits.mode(),  # "shared" (Redis), or "local (why)"
    }
    if snapshot is not None and snapshot.nodes:
        identity = front_gateway().identity
        body["node"] = identity.name if identity else ""
        body["nodes"] = {name: node.status for name, node in snapshot.nodes.items()}
    return JsonResponse(body, status=200)


async def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics in Prometheus' text format (the fleet's gauges and counters
    as last read, while the database is down)."""
    metrics.FLEET.snapshot = await _fleet_or_last() or metrics.FLEET.snapshot
    try:
        restarts, model_queues = await _engine_counters()
    except db.Error as error:
        DATABASE_OUTAGE.failed("reading the engines' counters", error)
    else:
        metrics.FLEET.restarts, metrics.FLEET.model_queues = restarts, model_queues
    return HttpResponse(
        metrics.exposition(), content_type="text/plain; version=0.0.4; charset=utf-8"
    )
