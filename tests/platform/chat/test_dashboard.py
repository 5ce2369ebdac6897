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

from fleet.models import EngineState
from tests.platform.api.chat_front import CHAT
from tests.platform.chat.dashboard import (
    fleet_message,
    fleet_rows,
    next_notice,
    staff_socket,
)
from tests.platform.chat.sockets import Socket, session_cookie
from tests.platform.staff import CHANGE, staff_member

pytestmark = pytest.mark.django_db(transaction=True)


async def test_page_is_for_staff_only(engine):
    """Anonymous and non-staff visitors are sent to log in; staff get the
    page with the fleet in it."""
    await sync_to_async(fleet_rows)()
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
    spec = await sync_to_async(fleet_rows)()
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
    spec = await sync_to_async(fleet_rows)()
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
    notice = await next_notice(socket)
    assert notice == {
        "type": "notice",
        "text": f"Unloaded {CHAT} from streams0.",
        "level": "info",
    }
    models = (await asyncio.to_thread(engine.client().state)).models
    assert CHAT not in [m.name for m in models]

    loaded = await client.post(url + "load/", {"model": CHAT}, headers=csrf)
    assert loaded.status_code == 202
    notice = await next_notice(socket)
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
