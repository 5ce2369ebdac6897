"""The live dashboard as the dashboard tests drive it: a fleet to show, a staff
member's socket on it, and the fleet and notice messages it receives."""

from asgiref.sync import sync_to_async

from catalog.models import ModelConfig
from fleet.models import EngineSpec, EngineState
from tests.factories import EngineSpecFactory
from tests.platform.api.chat_front import CHAT
from tests.platform.chat.sockets import Socket, session_cookie


def fleet_rows() -> EngineSpec:
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


async def next_notice(socket: Socket) -> dict:
    while True:
        message = await socket.receive()
        if message["type"] == "notice":
            return message
