"""The dashboard's orders check their permissions: a restart needs
`fleet.change_enginespec`, a load or an unload `catalog.change_modelconfig`;
a staff member without them gets 403 and nothing changes, and the page shows
them no button for it. A disabled model is never loaded, whoever asks."""

import pytest
from asgiref.sync import sync_to_async
from django.contrib.admin.models import LogEntry
from django.test import AsyncClient

from catalog.models import ModelConfig
from tests.platform.api.chat_front import CHAT
from tests.platform.chat.dashboard import (
    fleet_message,
    fleet_rows,
    next_notice,
    staff_socket,
)
from tests.platform.staff import CHANGE, VIEW, staff_member

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/dashboard/engines/streams0/"


async def logged_in(name: str, permissions: list[str]) -> AsyncClient:
    user = await sync_to_async(staff_member)(name, permissions)
    client = AsyncClient()
    await client.aforce_login(user)
    return client


async def test_orders_need_their_permissions(socket_app, engine):
    """A viewer's restart, load and unload get 403 naming the permission
    each needs, and change and record nothing; the page tells its script to
    show none of those buttons. An operator's restart and load are taken
    (the control), and the page shows the buttons."""
    spec = await sync_to_async(fleet_rows)()
    viewer = await logged_in("viewer", VIEW)
    for order, needed in [
        ("restart/", "fleet.change_enginespec"),
        ("load/", "catalog.change_modelconfig"),
        ("unload/", "catalog.change_modelconfig"),
    ]:
        refused = await viewer.post(URL + order, {"model": CHAT})
        assert refused.status_code == 403
        assert needed in refused.json()["message"]
    await spec.arefresh_from_db()
    assert spec.restart_requested_at is None
    assert not await LogEntry.objects.aexists()
    page = await viewer.get("/dashboard/")
    assert page.context["allowed"] == {"restart": False, "place": False}

    operator = await logged_in("operator", [*VIEW, *CHANGE])
    page = await operator.get("/dashboard/")
    assert page.context["allowed"] == {"restart": True, "place": True}
    assert (await operator.post(URL + "restart/")).status_code == 200
    await spec.arefresh_from_db()
    assert spec.restart_requested_at is not None
    socket = await staff_socket(socket_app, "watcher")
    await fleet_message(socket)
    loaded = await operator.post(URL + "load/", {"model": CHAT})
    assert loaded.status_code == 202
    assert (await next_notice(socket))["text"].startswith(f"Loaded {CHAT} on streams0")
    await socket.close()


async def test_a_disabled_model_is_never_loaded(socket_app, engine):
    """Even a load of a disabled model by one who may load is refused (400, saying it
    is disabled) and nothing is recorded; enabled again, the same order is
    taken (the control)."""
    await sync_to_async(fleet_rows)()
    await ModelConfig.objects.filter(name=CHAT).aupdate(enabled=False)
    chief = await logged_in("chief", [*VIEW, *CHANGE])
    refused = await chief.post(URL + "load/", {"model": CHAT})
    assert refused.status_code == 400
    assert refused.json()["message"] == (
        f"{CHAT} is disabled: enable it in the admin to load it."
    )
    assert not await LogEntry.objects.aexists()

    await ModelConfig.objects.filter(name=CHAT).aupdate(enabled=True)
    socket = await staff_socket(socket_app, "watcher")
    await fleet_message(socket)
    assert (await chief.post(URL + "load/", {"model": CHAT})).status_code == 202
    assert (await next_notice(socket))["text"].startswith(f"Loaded {CHAT}")
    await socket.close()
