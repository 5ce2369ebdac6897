"""Node links (engines/wire/link*.py) against a real engine: a relay on loopback in
the test's event loop, the same client as for a local engine over it, and a
proxy between them that can go silent (a cut cable, as iptables DROP does
across hosts; the multi-host tests in tests/cluster/ do it for real)."""

import asyncio
import struct

import pytest
from node_link.client import RemoteEngineClient
from node_link.protocol import LINK_HEADER, MAX_LINK_PAYLOAD, OPEN
from node_link.relay import NodeRelay

from cluster.tls import relay_certificate, server_tls_context
from engines.wire.client import AsyncEngineClient, EngineDied, EngineUnreachable
from engines.wire.framing import encode_message, read_frame
from engines.wire.replies import TokenFrame
from engines.wire.requests import GenerateRequest
from tests.engines.conftest import free_port
from tests.engines.generating import SMOL
from tests.platform.node_link.links import GREEDY, SECRET, relay_for, remote
from tests.waiting import await_for


async def slots_in_use(engine) -> int:
    return (await engine.aclient().state()).slots_in_use


async def test_a_generation_over_a_link_is_the_one_on_loopback(engine):
    """The same greedy answer, whole and streamed, as the engine gives on
    loopback; several streams share one link."""
    local = await engine.aclient().generate(GenerateRequest(model=SMOL, **GREEDY))
    async with relay_for(engine) as (relay, port):
        client, pool = remote(port)
        whole = await client.generate(GenerateRequest(model=SMOL, **GREEDY))
        pieces = [
            frame.text
            async for frame in client.generate_stream(
                GenerateRequest(model=SMOL, **GREEDY)
            )
            if isinstance(frame, TokenFrame)
        ]
        both = await asyncio.gather(
            client.generate(GenerateRequest(model=SMOL, **GREEDY)),
            client.generate(GenerateRequest(model=SMOL, **GREEDY)),
        )
        assert relay.links_of("a") == 1
        pool.close()
    assert whole.text == local.text != ""
    assert "".join(pieces) == local.text
    assert [answer.text for answer in both] == [local.text] * 2


async def test_a_wrong_secret_or_an_unknown_engine_is_unreachable(engine):
    """Refusals reach the caller as EngineUnreachable (it tries another
    replica), with the reason; control: the right secret and engine work."""
    async with relay_for(engine) as (_, port):
        wrong, pool = remote(port, secret="not-the-secret")
        with pytest.raises(EngineUnreachable, match="link refused"):
            await wrong.generate(GenerateRequest(model=SMOL, **GREEDY))
        pool.close()
        unknown, pool = remote(port, engine="e9")
        with pytest.raises(EngineUnreachable, match="no engine 'e9' on node b"):
            await unknown.generate(GenerateRequest(model=SMOL, **GREEDY))
        odd, _ = remote(port, engine="../e1")
        odd.pool = pool
        with pytest.raises(EngineUnreachable, match="not an engine name"):
            await odd.generate(GenerateRequest(model=SMOL, **GREEDY))
        right, _ = remote(port)
        right.pool = pool
        assert (await right.generate(GenerateRequest(model=SMOL, **GREEDY))).text
        pool.close()


async def test_hanging_up_a_stream_over_a_link_cancels_it_in_the_engine(engine):
    """Closing the stream sends CLOSE; the relay hangs up on the engine, whose
    slot is free again (control: it is busy while the stream is read)."""
    async with relay_for(engine) as (_, port):
        client, pool = remote(port)
        frames = client.generate_stream(
            GenerateRequest(
                model=SMOL, messages=GREEDY["messages"], max_tokens=400, ignore_eos=True
            )
        )
        async for frame in frames:
            if isinstance(frame, TokenFrame):
                break
        assert await slots_in_use(engine) == 1
        await frames.aclose()
        await await_for(
            lambda: _idle(engine), timeout=10, what="the engine's slot to be freed"
        )
        pool.close()


async def _idle(engine) -> bool:
    return await slots_in_use(engine) == 0


class Cable:
    """A TCP proxy that can be cut silently: bytes stop flowing both ways and
    nothing is closed (as a dropped link looks to both ends)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.cut = asyncio.Event()
        self.port = free_port()
        self._server = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def close(self) -> None:
        self._server.close()

    async def _handle(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(
            self._copy(reader, up_writer), self._copy(up_reader, writer)
        )

    async def _copy(self, reader, writer) -> None:
        while chunk := await reader.read(65536):
            if self.cut.is_set():
                await asyncio.Event().wait()  # silent: hold everything forever
            writer.write(chunk)
            await writer.drain()
        writer.close()


async def test_a_silent_link_fails_its_streams_and_frees_the_engine(engine):
    """Cut the cable mid-stream: the caller's stream fails as a dropped
    connection (EngineDied) once the link's keepalive has heard nothing for
    LINK_DEAD_S (its reason says so), and the relay, hearing nothing more,
    hangs up on the engine, which frees the slot."""
    async with relay_for(engine) as (_, port):
        cable = Cable(port)
        await cable.start()
        client, pool = remote(cable.port)
        frames = client.generate_stream(
            GenerateRequest(
                model=SMOL,
                messages=GREEDY["messages"],
                max_tokens=100_000,
                ignore_eos=True,
            )
        )
        async for frame in frames:
            if isinstance(frame, TokenFrame):
                break
        cable.cut.set()
        with pytest.raises(EngineDied, match="link to node b lost: no answer in"):
            async for _ in frames:
                pass
        await await_for(lambda: _idle(engine), timeout=20, what="the relay to hang up")
        pool.close()
        await cable.close()


async def test_a_link_frame_over_the_cap_is_refused_before_it_is_read(engine):
    """A header announcing more than MAX_LINK_PAYLOAD closes the link at once:
    the relay does not wait for (or allocate) the payload."""
    async with relay_for(engine) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        hello = {"kind": "link", "version": 1, "node": "a", "secret": SECRET}
        writer.write(encode_message(hello))
        assert (await read_frame(reader))[:15] == b'{"status":"ok",'
        writer.write(LINK_HEADER.pack(1, OPEN, MAX_LINK_PAYLOAD + 1))
        await writer.drain()
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed, nothing more sent
        writer.close()


async def test_a_hello_is_read_with_a_small_cap():
    """The first frame may announce at most 4 KiB: a bigger one is refused
    from its header."""

    async def never(node, secret):  # noqa: ARG001
        raise AssertionError("an oversized hello must not be checked")

    relay = NodeRelay(node="b", authenticate=never, engine_address=lambda name: None)
    port = free_port()
    await relay.start("127.0.0.1", port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(struct.pack(">Q", 64 * 1024 * 1024))
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        writer.close()
    finally:
        await relay.close()


async def test_tls_with_the_pinned_certificate_and_not_another(engine, tmp_path):
    """With TLS the caller checks the relay's certificate against the pinned
    SHA-256: the right pin serves, another is refused before the hello (the
    secret is never sent to a relay that is not the node's)."""
    key, cert, fingerprint = relay_certificate(tmp_path, "b")
    assert (key.stat().st_mode & 0o777) == 0o600
    async with relay_for(engine, tls=server_tls_context(key, cert)) as (_, port):
        client, pool = remote(port, pinned=fingerprint)
        assert (await client.generate(GenerateRequest(model=SMOL, **GREEDY))).text
        pool.close()
        impostor, pool = remote(port, pinned="0" * 64)
        with pytest.raises(EngineUnreachable, match="not the one pinned"):
            await impostor.generate(GenerateRequest(model=SMOL, **GREEDY))
        pool.close()


def test_a_local_client_is_unchanged_by_links(engine):
    """The remote client is the local one with another transport."""
    assert issubclass(RemoteEngineClient, AsyncEngineClient)
