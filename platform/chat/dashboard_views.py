"""The fleet dashboard's page (`/dashboard/`) and an operator's orders from it:
restart an engine, load or unload a model. Staff only, CSRF-checked POSTs,
each recorded in the admin's history (LogEntry) of the engine or the model,
and each needing the permission to change what it records: a restart
`fleet.change_enginespec`, a load or an unload `catalog.change_modelconfig`
(403 otherwise; the page shows only the buttons its user may use). A disabled
model is never loaded, whoever asks.

A restart is asked of the supervisor (it polls the database); a load or an
unload goes to the running engine at once, in the background: the answer says
the order was given, and every open dashboard is told how it went."""

from asgiref.sync import sync_to_async
from django import db
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Model
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from api.calls import spawn
from api.errors import ApiError
from api.gateway import front_gateway
from catalog.models import ModelConfig
from engines.wire.client import AsyncEngineClient, EngineError, EngineUnreachable
from fleet.models import EngineSpec
from fleet.services import (
    engine_model_load,
    engine_model_unload,
    engine_restart_request,
)

from .dashboard import dashboard_fleet, dashboard_notice

# The permission each order needs: to change what it is recorded on.
RESTART_PERMISSION = "fleet.change_enginespec"
PLACE_PERMISSION = "catalog.change_modelconfig"


@staff_member_required
def dashboard_page(request: HttpRequest) -> HttpResponse:
    """GET /dashboard/: the fleet now; the page then follows /ws/dashboard/."""
    allowed = {
        "restart": request.user.has_perm(RESTART_PERMISSION),
        "place": request.user.has_perm(PLACE_PERMISSION),
    }
    return render(
        request,
        "chat/dashboard.html",
        {"fleet": dashboard_fleet(), "allowed": allowed},
    )


def _history(user_id: int, obj: Model, message: str) -> None:
    """Record the order in the admin's history of `obj`."""
    LogEntry.objects.log_actions(user_id, [obj], CHANGE, message, single_object=True)


def _refused(message: str, status: int = 400) -> JsonResponse:
    return JsonResponse({"message": message}, status=status)


def _forbidden(what: str, permission: str) -> JsonResponse:
    return _refused(f"You may not {what}: it needs the permission {permission!r}.", 403)


@require_POST
@staff_member_required
def engine_restart(request: HttpRequest, name: str) -> HttpResponse:
    """POST /dashboard/engines/<name>/restart/."""
    if not request.user.has_perm(RESTART_PERMISSION):
        return _forbidden("restart engines", RESTART_PERMISSION)
    spec = EngineSpec.objects.filter(name=name).first()
    if spec is None:
        return _refused(f"No engine named {name!r}.", 404)
    engine_restart_request(spec=spec)
    _history(request.user.pk, spec, "Restart requested from the dashboard.")
    return JsonResponse(
        {"message": f"Restart of {name} requested: the supervisor drains it first."}
    )


def _ordered(
    *, user_id: int, engine: str, model: str, message: str, loading: bool
) -> tuple[EngineSpec, ModelConfig]:
    """The engine and the model of a load or unload order, recorded in the
    model's history; LookupError for either unknown, ValueError for a load
    of a disabled model."""
    spec = EngineSpec.objects.filter(name=engine).first()
    if spec is None:
        raise LookupError(f"No engine named {engine!r}.")
    config = ModelConfig.objects.filter(name=model).first()
    if config is None:
        raise LookupError(f"No model named {model!r}.")
    if loading and not config.enabled:
        raise ValueError(
            f"{config.name} is disabled: enable it in the admin to load it."
        )
    _history(user_id, config, message.format(engine=spec.name))
    return spec, config


async def _model_order(
    request: HttpRequest,
    name: str,
    *,
    recorded: str,
    carry_out,
    accepted: str,
    loading: bool,
) -> HttpResponse:
    """A load or unload order: checked and recorded now (`recorded`, with
    `{engine}`), carried out in the background by `carry_out(engine, model)`;
    202 with `accepted` (with `{engine}` and `{model}`)."""
    user = await request.auser()
    if not await sync_to_async(user.has_perm)(PLACE_PERMISSION):
        return _forbidden("load or unload models", PLACE_PERMISSION)
    try:
        spec, model = await sync_to_async(_ordered)(
            user_id=user.pk,
            engine=name,
            model=request.POST.get("model", ""),
            message=recorded,
            loading=loading,
        )
    except LookupError as missing:
        return _refused(str(missing), 404)
    except ValueError as refused:
        return _refused(str(refused))
    said = accepted.format(engine=spec.name, model=model.name)
    spawn(carry_out(spec.name, model.name), said)
    return JsonResponse({"message": said}, status=202)


@require_POST
@staff_member_required
async def model_load(request: HttpRequest, name: str) -> HttpResponse:
    """POST /dashboard/engines/<name>/load/ (model=...)."""
    return await _model_order(
        request,
        name,
        recorded="Load on engine {engine} ordered from the dashboard.",
        carry_out=_load,
        accepted="Loading {model} on {engine}…",
        loading=True,
    )


@require_POST
@staff_member_required
async def model_unload(request: HttpRequest, name: str) -> HttpResponse:
    """POST /dashboard/engines/<name>/unload/ (model=...)."""
    return await _model_order(
        request,
        name,
        recorded="Unload from engine {engine} ordered from the dashboard.",
        carry_out=_unload,
        accepted="Unloading {model} from {engine} once it is idle…",
        loading=False,
    )


async def _client(engine: str) -> AsyncEngineClient:
    """The engine's client, of this host or over the link to its node."""
    gateway = front_gateway()
    try:
        snapshot = await gateway.snapshot()
    except (ApiError, db.Error) as error:
        raise EngineUnreachable(f"the fleet cannot be read now: {error}") from None
    return gateway.client(engine, snapshot)


async def _load(engine: str, model: str) -> None:
    try:
        loaded = await engine_model_load(
            engine=engine, model=model, client=await _client(engine)
        )
    except EngineError as error:
        await dashboard_notice(
            f"Could not load {model} on {engine}: {error}", level="error"
        )
        return
    await dashboard_notice(f"Loaded {model} on {engine} ({loaded.memory_mib:.0f} MiB).")


async def _unload(engine: str, model: str) -> None:
    try:
        await engine_model_unload(
            engine=engine, model=model, client=await _client(engine)
        )
    except EngineError as error:
        await dashboard_notice(
            f"Could not unload {model} from {engine}: {error}", level="error"
        )
        return
    await dashboard_notice(f"Unloaded {model} from {engine}.")
