"""A session socket's login is checked again while the socket is open: real
logins through Django's test client (the session in the store, its cookie on
the socket), real sockets (roundhouse.asgi's websocket application), a real
engine serving SmolLM2. Once the login ends, the socket is closed with 4401
and its streams are cancelled in the engine; a login that holds keeps its
socket."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.test import Client

from chat.consumers import ChatConsumer
from tests.platform.api.chat_front import ESSAY, engine_idle, within
from tests.platform.chat.sockets import Socket, chat

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "pw-not-real"


@pytest.fixture
def checks(monkeypatch) -> asyncio.Queue:
    """Each check of a socket's login, (username, whether it held), as the
    sockets make them: every 0.05 s here."""
    monkeypatch.setattr(ChatConsumer, "SESSION_CHECK_S", 0.05)
    made: asyncio.Queue = asyncio.Queue()
    checked = ChatConsumer.login_holds

    async def recorded(self) -> bool:
        holds = await checked(self)
        made.put_nowait((self.user.get_username(), holds))
        return holds

    monkeypatch.setattr(ChatConsumer, "login_holds", recorded)
    return made


def log_in(username: str) -> tuple[object, Client]:
    """A new user, logged in with its password by a client of its own."""
    user = get_user_model().objects.create_user(username, password=PASSWORD)
    client = Client()
    assert client.login(username=username, password=PASSWORD)
    return user, client


async def browser_socket(app, client: Client) -> Socket:
    """The logged-in client's socket, ready."""
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    socket = Socket(app, headers=[(b"cookie", cookie)])
    assert await socket.open()
    assert (await socket.receive())["type"] == "ready"
    return socket


async def checked_after(checks: asyncio.Queue, username: str) -> None:
    """Wait for a check of this user's socket made from now on that held."""
    while not checks.empty():
        checks.get_nowait()
    while (await within(checks.get())) != (username, True):
        pass


def deactivate(user) -> None:
    user.is_active = False
    user.save(update_fields=["is_active"])


def change_password(user) -> None:
    user.set_password("another-pw-not-real")
    user.save()


async def test_logging_out_closes_the_socket_and_a_login_that_holds_stays(
    socket_app, engine, checks
):
    """Logged out (the session deleted from the store): the socket is closed
    with 4401 and a reason. The control: another user's socket, still logged
    in, was checked after that and still answers a chat."""
    _, leaving = await sync_to_async(log_in)("lea")
    _, staying = await sync_to_async(log_in)("sam")
    gone = await browser_socket(socket_app, leaving)
    kept = await browser_socket(socket_app, staying)
    await sync_to_async(leaving.logout)()
    closed = (await gone.until("closed"))[-1]
    assert closed["code"] == 4401 and "log in again" in closed["reason"]
    await checked_after(checks, "sam")
    await kept.send(chat("still"))
    assert (await kept.until("done", "still"))[-1]["finish_reason"]
    await kept.close()
    await gone.close()


@pytest.mark.parametrize("ended_by", [deactivate, change_password])
async def test_a_login_that_ends_mid_stream_closes_the_socket_and_its_streams(
    socket_app, engine, checks, ended_by
):
    """The user made inactive, or their password changed (which ends their
    other sessions): the socket is closed with 4401 while its stream runs, and
    the stream is cancelled in the engine."""
    user, client = await sync_to_async(log_in)("ida")
    socket = await browser_socket(socket_app, client)
    await socket.send(chat("long", ESSAY, params={"max_tokens": 400}))
    await socket.until("token", "long")
    await sync_to_async(ended_by)(user)
    seen = await socket.until("closed")
    assert seen[-1]["code"] == 4401
    assert not [m for m in seen if m["type"] == "done"]
    await engine_idle(engine)
    await socket.close()
