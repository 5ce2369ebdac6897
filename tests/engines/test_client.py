"""AsyncEngineClient's connection: the request is on the wire before the client
first yields to the event loop, and it still gets through when the handshake
cannot complete at once."""

import asyncio
import socket

import pytest

from engines.wire.bounds import MAX_AUTH_FRAME_BYTES
from engines.wire.client import AsyncEngineClient, EngineUnreachable
from engines.wire.framing import decode_message, recv_frame
from engines.wire.requests import PingRequest
from tests.waiting import await_for, suspended_in


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server
    server.close()


def received(server: socket.socket) -> tuple[dict, dict]:
    """The auth frame and the request a connection opened with."""
    connection, _ = server.accept()
    with connection:
        connection.settimeout(10)
        auth = decode_message(recv_frame(connection, max_bytes=MAX_AUTH_FRAME_BYTES))
        return auth, decode_message(recv_frame(connection))


async def test_the_request_is_sent_before_the_first_yield(listener):
    """The client's task runs one step (up to its first suspension); then, with
    the event loop held, the engine's side can already read the whole request:
    in a burst of requests each leaves as soon as it is handled."""
    client = AsyncEngineClient(port=listener.getsockname()[1], token="t0ken")
    opening = asyncio.ensure_future(client._open(PingRequest()))
    await asyncio.sleep(0)  # the task's first step runs before this returns
    listener.settimeout(1)
    assert received(listener) == ({"kind": "auth", "token": "t0ken"}, {"kind": "ping"})
    _, writer = await opening
    writer.close()


async def test_a_full_listen_queue_waits_for_the_handshake():
    """Connections the engine has not accepted fill its queue: the next one's
    handshake is pending, so the client waits for it instead of failing."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    address = server.getsockname()
    fillers = []
    try:
        while True:  # fill the queue until a handshake cannot complete
            probe = socket.socket()
            probe.setblocking(False)
            probe.connect_ex(address)
            fillers.append(probe)
            try:
                probe.send(b"-")
            except BlockingIOError:
                break
        client = AsyncEngineClient(port=address[1], token="t0ken")
        opening = asyncio.ensure_future(client._open(PingRequest()))
        # It has had its chance to fail: it is waiting for the connection.
        await await_for(
            lambda: "open_connection" in suspended_in(opening),
            what="the client waiting for the handshake",
        )
        # The engine catches up: accept every queued connection.
        loop = asyncio.get_running_loop()
        accepted = []

        def accept_all() -> tuple[dict, dict]:
            server.settimeout(5)
            while True:
                connection, _ = server.accept()
                accepted.append(connection)
                connection.settimeout(0.5)
                try:
                    auth = decode_message(recv_frame(connection))
                    message = decode_message(recv_frame(connection))
                except (TimeoutError, OSError):
                    continue
                if message.get("kind") == "ping":
                    return auth, message

        opened = await loop.run_in_executor(None, accept_all)
        _, writer = await asyncio.wait_for(opening, 5)
        writer.close()
        assert opened == ({"kind": "auth", "token": "t0ken"}, {"kind": "ping"})
    finally:
        for probe in fillers:
            probe.close()
        for connection in locals().get("accepted", []):
            connection.close()
        server.close()


async def test_nothing_listening_is_unreachable():
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    client = AsyncEngineClient(port=port, token="t0ken", name="gone")
    with pytest.raises(EngineUnreachable, match="engine gone"):
        await client.ping()
