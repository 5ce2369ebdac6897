"""A client's end of the WebSocket chat, as the chat tests open it: a socket, one
authenticated by an API key, a chat message, and a logged-in session."""

import json

from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from api.models import ApiKey
from tests.platform.api.chat_front import CHAT, within


class Socket:
    """A client's end of one chat socket."""

    def __init__(self, app, *, path="/ws/chat/", headers=()) -> None:
        self.communicator = WebsocketCommunicator(app, path, headers=headers)

    async def open(self) -> bool:
        connected, _ = await self.communicator.connect(timeout=10)
        return connected

    async def send(self, message: dict | str) -> None:
        text = message if isinstance(message, str) else json.dumps(message)
        await self.communicator.send_to(text_data=text)

    async def receive(self) -> dict:
        output = await within(self.communicator.receive_output(timeout=30))
        if output["type"] == "websocket.close":
            return {**output, "type": "closed"}
        return json.loads(output["text"])

    async def until(self, kind: str, stream_id: str | None = None) -> list[dict]:
        """Messages up to and including the first of this type (and id)."""
        seen = []
        while True:
            message = await self.receive()
            seen.append(message)
            if message["type"] == kind and (
                stream_id is None or message.get("id") == stream_id
            ):
                return seen

    async def close(self) -> None:
        await self.communicator.disconnect()


async def keyed_socket(app, key: ApiKey) -> Socket:
    socket = Socket(app)
    assert await socket.open()
    await socket.send({"type": "auth", "key": key.plaintext})
    assert (await socket.receive()) == {"type": "ready", "key": key.name}
    return socket


def chat(stream_id: str, content: str = "Name a colour.", **extra) -> dict:
    params = extra.pop("params", {"max_tokens": 8, "temperature": 0})
    return {
        "type": "chat",
        "id": stream_id,
        "model": CHAT,
        "messages": [{"role": "user", "content": content}],
        "params": params,
        **extra,
    }


def session_cookie(username: str, *, staff: bool = False) -> tuple[object, str]:
    """A new user (staff if asked) and the id of a session logged in as it."""
    user = get_user_model().objects.create_user(
        username, password="pw-not-real", is_staff=staff
    )
    client = Client()
    client.force_login(user)
    return user, client.cookies["sessionid"].value
