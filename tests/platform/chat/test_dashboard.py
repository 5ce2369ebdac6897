"""The fleet dashboard: its page (staff only), its live feed over the channel
layer (in memory and Redis), and an operator's orders (CSRF-checked, in the
admin's history), one of them carried out by a real engine."""

import asyncio
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.layers import channel_layers
from django.contrib.admin.models import LogEntry
from django.test import AsyncClient

from catalog.models import ModelConfig
from fleet.models import EngineSpec, EngineState
from tests.factories import EngineSpecFactory
from tests.platform.api.test_streams import CHAT
from tests.platform.chat.test_websocket import Socket, session_cookie
from tests.platform.test_staff_permissions import CHANGE, staff_member

pytestmark = pytest.mark.django_db(transaction=True)


def _fleet_rows() -> EngineSpec:
    spec = EngineSpecFactory(name="streams0")
    EngineState.objects.create(
        spec=spec,
        status="ready",
        pid=4242,
        resident_models=[{"name": CHAT, "memory_mib": 180.0}],
        temperatures=[{"device": "CPU", "celsius": 48.0}],
        memory_mib=512.0,
        tokens_generated=10,
    )
    ModelConfig.objects.update_or_create(
        name=CHAT,
        defaults={
            "format": "gguf",
            "task": "chat",
            "path": "SmolLM2-135M-Instruct.Q4_1.gguf",
        },
    )
    return spec


async def staff_socket(app, username="ops") -> Socket:
    _, session = await sync_to_async(session_cookie)(username, staff=True)
    socket = Socket(
        app,
        path="/ws/dashboard/",
        headers=[(b"cookie", f"sessionid={session}".encode())],
    )
    assert await socket.open()
    return socket


async def fleet_message(socket: Socket, check=lambda fleet: True) -> dict:
    """The next `fleet` message whose fleet passes `check`."""
    while True:
        message = await socket.receive()
        if message["type"] == "fleet" and check(message["fleet"]):
            return message


async def test_page_is_for_staff_only(engine):
    """Anonymous and non-staff visitors are sent to log in; staff get the
    page with the fleet in it."""
    await sync_to_async(_fleet_rows)()
    client = AsyncClient()
    assert (await client.get("/dashboard/")).status_code == 302
    user, _ = await sync_to_async(session_cookie)("visitor")
    await client.aforce_login(user)
    assert (await client.get("/dashboard/")).status_code == 302
    staff, _ = await sync_to_async(session_cookie)("boss", staff=True)
    await client.aforce_login(staff)
    page = await client.get("/dashboard/")
    assert page.status_code == 200
    body = page.content.decode()
    assert '"name": "streams0"' in body and "uPlot" in body


@pytest.mark.parametrize("layer", ["memory", "redis"])
async def test_live_updates_reach_the_dashboard(socket_app, settings, layer):
    """A staff socket gets the fleet at once, then the supervisor's next
    write within about a second, over the in-memory channel layer and over
    channels_redis. A non-staff socket is closed with 4403."""
    if layer == "redis":
        prefix = f"test-{uuid.uuid4().hex[:8]}"
        settings.CHANNEL_LAYERS = {
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {"hosts": ["redis://127.0.0.1:6379/0"], "prefix": prefix},
            }
        }
        await sync_to_async(channel_layers.backends.clear)()
    spec = await sync_to_async(_fleet_rows)()
    socket = await staff_socket(socket_app)
    first = await fleet_message(socket)
    (engine,) = first["fleet"]["engines"]
    assert (engine["name"], engine["status"], engine["pid"]) == (
        "streams0",
        "ready",
        4242,
    )
    assert engine["models"][0]["name"] == CHAT
    assert engine["temperatures"] == [{"device": "CPU", "celsius": 48.0}]
    await EngineState.objects.filter(spec=spec).aupdate(
        queue_depth=4, cooling_reason="CPU (cpu) at 93 °C"
    )
    updated = await fleet_message(
        socket, lambda fleet: fleet["engines"][0]["queue_depth"] == 4
    )
    assert updated["fleet"]["engines"][0]["cooling_reason"].startswith("CPU")
    assert updated["sample"]["engines"]["streams0"]["queue"] == 4
    await socket.close()

    _, session = await sync_to_async(session_cookie)("not-staff")
    visitor = Socket(
        socket_app,
        path="/ws/dashboard/",
        headers=[(b"cookie", f"sessionid={session}".encode())],
    )
    assert await visitor.open()
    closed = await visitor.receive()
    assert closed["type"] == "closed" and closed["code"] == 4403
    if layer == "redis":
        await sync_to_async(channel_layers.backends.clear)()


async def test_orders_need_csrf_and_are_recorded_and_carried_out(socket_app, engine):
    """Restart, unload and load by a staff member who may change engines and
    models: refused without the CSRF token; with it, recorded in the admin's
    history, the restart asked of the supervisor, and the unload and load
    carried out by the engine, every dashboard told how it went."""
    spec = await sync_to_async(_fleet_rows)()
    staff = await sync_to_async(staff_member)("chief", CHANGE)
    client = AsyncClient(enforce_csrf_checks=True)
    await client.aforce_login(staff)
    url = "/dashboard/engines/streams0/"
    assert (await client.post(url + "restart/")).status_code == 403
    await client.get("/dashboard/")  # sets the CSRF cookie
    csrf = {"X-CSRFToken": client.cookies["csrftoken"].value}

    restarted = await client.post(url + "restart/", headers=csrf)
    assert restarted.status_code == 200
    await spec.arefresh_from_db()
    assert spec.restart_requested_at is not None

    socket = await staff_socket(socket_app, "watcher")
    await fleet_message(socket)
    unloaded = await client.post(url + "unload/", {"model": CHAT}, headers=csrf)
    assert unloaded.status_code == 202
    notice = await _notice(socket)
    assert notice == {
        "type": "notice",
        "text": f"Unloaded {CHAT} from streams0.",
        "level": "info",
    }
    models = (await asyncio.to_thread(engine.client().state)).models
    assert CHAT not in [m.name for m in models]

    loaded = await client.post(url + "load/", {"model": CHAT}, headers=csrf)
    assert loaded.status_code == 202
    notice = await _notice(socket)
    assert notice["text"].startswith(f"Loaded {CHAT} on streams0 (")
    models = (await asyncio.to_thread(engine.client().state)).models
    assert CHAT in [m.name for m in models]

    missing = await client.post(url + "load/", {"model": "nope"}, headers=csrf)
    assert missing.status_code == 404
    history = [entry.change_message async for entry in LogEntry.objects.order_by("pk")]
    assert history == [
        "Restart requested from the dashboard.",
        "Unload from engine streams0 ordered from the dashboard.",
        "Load on engine streams0 ordered from the dashboard.",
    ]
    await socket.close()


async def _notice(socket: Socket) -> dict:
    while True:
        message = await socket.receive()
        if message["type"] == "notice":
            return message
