"""AsyncEngineClient's connection: the request is on the wire before the client
first yields to the event loop, and it still gets through when the handshake
cannot complete at once. Both clients: the same calls, and the same error for
the same bad answer."""

import asyncio
import inspect
import socket
import threading

import pytest

from engines.wire.bounds import MAX_AUTH_FRAME_BYTES, MAX_FRAME_BYTES
from engines.wire.client import (
    AsyncEngineClient,
    EngineClient,
    EngineDied,
    EngineRequestError,
    EngineUnreachable,
)
from engines.wire.framing import HEADER, decode_message, recv_frame
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


def answering(server: socket.socket, answer: bytes) -> threading.Thread:
    """An engine's side that reads one request and writes `answer`."""

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            connection.settimeout(10)
            recv_frame(connection, max_bytes=MAX_AUTH_FRAME_BYTES)
            recv_frame(connection)
            connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


OVERSIZED = HEADER.pack(MAX_FRAME_BYTES + 1)  # a reply over the cap
CUT_SHORT = HEADER.pack(64) + b"{"  # a reply that ends inside its frame


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        (OVERSIZED, EngineRequestError, "exceeds the"),
        (CUT_SHORT, EngineDied, "engine e1"),
    ],
    ids=["over the cap", "cut short"],
)
async def test_both_clients_turn_a_bad_answer_into_the_same_error(
    listener, answer, error, message
):
    """An answer over the frame cap is EngineRequestError and one cut short is
    EngineDied, from the asyncio client as from the blocking one: one
    translation for both (control: the asyncio client let FrameTooLarge
    escape, which the API answered as a generic 500)."""
    port = listener.getsockname()[1]
    served = answering(listener, answer)
    with pytest.raises(error, match=message):
        await AsyncEngineClient(port=port, token="t0ken", name="e1").ping()
    served.join(10)
    served = answering(listener, answer)
    blocking = EngineClient(port=port, token="t0ken", name="e1")
    with pytest.raises(error, match=message):
        await asyncio.to_thread(blocking.ping)
    served.join(10)


def test_the_two_clients_offer_the_same_calls():
    """Every call of one client exists on the other (control: embed_counted
    was the asyncio client's only), the asyncio ones as coroutines."""

    def calls(cls) -> dict[str, object]:
        return {
            name: getattr(cls, name)
            for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))
        }

    asynchronous, blocking = calls(AsyncEngineClient), calls(EngineClient)
    assert set(asynchronous) == set(blocking)
    for name, call in asynchronous.items():
        streaming = inspect.isasyncgenfunction(call)
        assert streaming or inspect.iscoroutinefunction(call) or name == "for_engine"
