"""Node links: how a front reaches an engine on another host.

Engines listen on 127.0.0.1 of their own host. Each host runs a relay (in its
supervisor) on the address the other nodes reach it at. A front opens one
long-lived link to each other node's relay, authenticated by the front's own
node secret (never a caller's API key), optionally in TLS with the relay's
pinned certificate, and carries every request to that node's engines over it:

    front ──link (one TCP/TLS connection per node pair, many streams)──▶ relay
    relay ──127.0.0.1, the engine's token──▶ engine

A stream is one engine connection, byte for byte: the relay opens it to the
engine with the engine's token and copies bytes both ways, so requests,
streamed frames and cancellation by hang-up work exactly as on loopback. The
client side is `RemoteEngineClient`, an AsyncEngineClient whose `_open` opens
a stream instead of a socket: one code path, only the transport differs.

Wire: the link opens with one engine-protocol frame (`LinkHello`, at most
4 KiB, read with a deadline) answered by `{"status": "ok", "node": ...}` or an
error frame. Then link frames: a 9-byte header (stream id u32, type u8,
length u32; payload at most MAX_LINK_PAYLOAD, refused before it is read) and
the payload. OPEN names the engine, DATA carries bytes, CLOSE is a hang-up
(either side), PING/PONG keep the link proven alive: a link that hears nothing
for LINK_DEAD_S is dropped, and every stream on it fails as a dropped
connection does (EngineDied), so a node cut off mid-stream is noticed within
seconds. An engine the relay cannot reach is answered in the stream as an
`unreachable` error frame: the caller tries another replica.
"""

import asyncio
import contextlib
import hashlib
import itertools
import logging
import re
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from engines.wire.bounds import (
    AUTH_TIMEOUT_S,
    CONTROL_TIMEOUT_S,
    MAX_AUTH_FRAME_BYTES,
    MAX_TOKEN_CHARS,
)
from engines.wire.client import AsyncEngineClient, EngineUnreachable, connect_and_send
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.frames import ErrorReply
from engines.wire.framing import auth_frame, decode_message, encode_message, read_frame
from engines.wire.requests import Request

log = logging.getLogger("roundhouse.link")

LINK_HEADER = struct.Struct(">IBI")  # stream id, frame type, payload length
MAX_LINK_PAYLOAD = 1 << 20
OPEN, DATA, CLOSE, PING, PONG = 1, 2, 3, 4, 5
FRAME_TYPES = frozenset({OPEN, DATA, CLOSE, PING, PONG})
# Engine names as the admin allows them (slugs): a stream naming anything else
# is refused before the relay looks for the engine.
ENGINE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# The client pings an idle link this often; a side that hears nothing for
# LINK_DEAD_S (client) or RELAY_DEAD_S (relay: it only answers) drops the link.
LINK_PING_S = 1.0
LINK_DEAD_S = 3.0
RELAY_DEAD_S = 5.0
# After a link to a node could not be made, requests for it fail at once for
# this long (they go to another replica) instead of each waiting to connect.
CONNECT_COOLDOWN_S = 1.0


class LinkRefused(Exception):
    """The relay refused the link (wrong or revoked secret, a node that cannot
    confirm its place in the cluster) or is not who it should be."""


class LinkHello(BaseModel):
    """A link's first frame: which node calls, and its secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(pattern="^link$")
    version: int = Field(ge=1, le=1)
    node: str = Field(min_length=1, max_length=64)
    secret: str = Field(min_length=1, max_length=MAX_TOKEN_CHARS)


class LinkWelcome(BaseModel):
    """The relay's answer to a hello it accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Literal["ok"] = "ok"
    node: str = Field(min_length=1, max_length=64)


# The relay's answer to a hello: a welcome, or why not.
WELCOME = TypeAdapter(
    Annotated[LinkWelcome | ErrorReply, Field(discriminator="status")]
)


def link_frame(stream: int, kind: int, payload: bytes = b"") -> bytes:
    return LINK_HEADER.pack(stream, kind, len(payload)) + payload


def data_frames(stream: int, data: bytes) -> bytes:
    """DATA frames carrying `data`, split at the payload cap."""
    view = memoryview(data)
    return b"".join(
        link_frame(stream, DATA, bytes(view[at : at + MAX_LINK_PAYLOAD]))
        for at in range(0, len(data), MAX_LINK_PAYLOAD)
    )


async def read_link_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """The next link frame; ProtocolError for an unknown type or a payload
    over the cap (before reading it), IncompleteReadError at the end."""
    stream, kind, size = LINK_HEADER.unpack(await reader.readexactly(LINK_HEADER.size))
    if kind not in FRAME_TYPES:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown link frame type {kind}")
    if size > MAX_LINK_PAYLOAD:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"link frame of {size} bytes exceeds the {MAX_LINK_PAYLOAD} cap",
        )
    return stream, kind, await reader.readexactly(size) if size else b""


def certificate_fingerprint(der: bytes) -> str:
    """The SHA-256 (hex) by which a relay's certificate is pinned."""
    return hashlib.sha256(der).hexdigest()


# -- the client side ------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A node's relay as a caller reaches it."""

    node: str
    host: str
    port: int
    tls_fingerprint: str = ""  # empty: plain TCP


class StreamWriter:
    """The writing half of one stream of a link, shaped like the part of
    asyncio.StreamWriter the engine clients use."""

    def __init__(self, link: "Link", stream: int) -> None:
        self._link = link
        self._stream = stream
        self._closed = False

    def write(self, data: bytes) -> None:
        if not self._closed:
            self._link.send(data_frames(self._stream, data))

    async def drain(self) -> None:
        await self._link.drain()

    def close(self) -> None:
        """Hang up: the relay closes the engine connection, which cancels the
        request there."""
        if not self._closed:
            self._closed = True
            self._link.hang_up(self._stream)

    def is_closing(self) -> bool:
        return self._closed


class Link:
    """One authenticated connection to another node's relay, carrying many
    streams. Built by LinkPool."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        peer: Peer,
        on_lost: Callable[["Link"], None],
    ) -> None:
        self.peer = peer
        self._reader = reader
        self._writer = writer
        self._on_lost = on_lost
        self._streams: dict[int, asyncio.StreamReader] = {}
        self._ids = itertools.count(1)
        self._heard_at = time.monotonic()
        self.lost: str | None = None
        self._tasks = [
            asyncio.ensure_future(self._read_loop()),
            asyncio.ensure_future(self._keepalive()),
        ]

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def open(self, engine: str, data: bytes) -> tuple[asyncio.StreamReader, Any]:
        """A new stream to `engine` on the peer, with `data` sent on it."""
        if self.lost is not None:
            raise ConnectionResetError(f"link to node {self.peer.node} lost")
        stream = next(self._ids)
        reader = asyncio.StreamReader(limit=MAX_LINK_PAYLOAD * 2)
        self._streams[stream] = reader
        self.send(
            link_frame(stream, OPEN, engine.encode("utf-8")) + data_frames(stream, data)
        )
        return reader, StreamWriter(self, stream)

    def send(self, data: bytes) -> None:
        if self.lost is None:
            self._writer.write(data)

    async def drain(self) -> None:
        if self.lost is None:
            await self._writer.drain()

    def hang_up(self, stream: int) -> None:
        if self._streams.pop(stream, None) is not None:
            self.send(link_frame(stream, CLOSE))

    def close(self, why: str = "closed") -> None:
        """Drop the link: every stream on it fails as a dropped connection."""
        if self.lost is not None:
            return
        self.lost = why
        error = ConnectionResetError(f"link to node {self.peer.node} lost: {why}")
        for reader in self._streams.values():
            reader.set_exception(error)
        self._streams.clear()
        self._writer.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._on_lost(self)

    async def _read_loop(self) -> None:
        try:
            while True:
                stream, kind, payload = await read_link_frame(self._reader)
                self._heard_at = time.monotonic()
                if kind == DATA:
                    reader = self._streams.get(stream)
                    if reader is not None:
                        reader.feed_data(payload)
                elif kind == CLOSE:
                    reader = self._streams.pop(stream, None)
                    if reader is not None:
                        reader.feed_eof()
                elif kind == PING:
                    self.send(link_frame(0, PONG))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as error:
            self.close(f"connection ended ({type(error).__name__})")
        except ProtocolError as error:
            self.close(error.message)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(LINK_PING_S)
            silent = time.monotonic() - self._heard_at
            if silent > LINK_DEAD_S:
                self.close(f"no answer in {silent:.1f} s")
                return
            self.send(link_frame(0, PING))


class LinkPool:
    """The links of one event loop, one per peer node, made on first use."""

    def __init__(self, *, node: str, secret: str) -> None:
        self.node = node
        self._secret = secret
        self._links: dict[str, Link] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._failed: dict[str, tuple[float, str]] = {}

    def __repr__(self) -> str:
        return f"LinkPool(node={self.node!r})"

    async def link(self, peer: Peer) -> Link:
        """The live link to `peer`, connecting if there is none; OSError,
        TimeoutError or LinkRefused when it cannot be made."""
        link = self._links.get(peer.node)
        if link is not None and link.lost is None and link.peer == peer:
            return link
        failed = self._failed.get(peer.node)
        if failed is not None and time.monotonic() - failed[0] < CONNECT_COOLDOWN_S:
            raise ConnectionRefusedError(f"node {peer.node}: {failed[1]} (just now)")
        pending = self._connecting.get(peer.node)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(peer))
            self._connecting[peer.node] = pending
            pending.add_done_callback(
                lambda _, name=peer.node: self._connecting.pop(name, None)
            )
        return await asyncio.shield(pending)

    async def _connect(self, peer: Peer) -> Link:
        try:
            link = await asyncio.wait_for(self._handshake(peer), CONTROL_TIMEOUT_S)
        except (OSError, TimeoutError, LinkRefused) as error:
            self._failed[peer.node] = (time.monotonic(), str(error) or "timed out")
            raise
        self._failed.pop(peer.node, None)
        old = self._links.get(peer.node)
        if old is not None:
            old.close("replaced")
        self._links[peer.node] = link
        return link

    async def _handshake(self, peer: Peer) -> Link:
        context = client_tls_context() if peer.tls_fingerprint else None
        reader, writer = await asyncio.open_connection(
            peer.host, peer.port, ssl=context
        )
        try:
            if context is not None:
                der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                if certificate_fingerprint(der) != peer.tls_fingerprint:
                    raise LinkRefused(
                        f"node {peer.node}: the relay's certificate is not the one "
                        "pinned for it"
                    )
            hello = LinkHello(
                kind="link", version=1, node=self.node, secret=self._secret
            )
            writer.write(
                encode_message(hello.model_dump(), max_bytes=MAX_AUTH_FRAME_BYTES)
            )
            reply = await read_frame(reader, max_bytes=MAX_AUTH_FRAME_BYTES)
            if reply is None:
                raise LinkRefused(f"node {peer.node}: the relay closed the link")
            answer = WELCOME.validate_python(decode_message(reply))
            if isinstance(answer, ErrorReply):
                raise LinkRefused(f"node {peer.node}: {answer.message}")
            if answer.node != peer.node:
                raise LinkRefused(f"the relay at {peer.host} is not node {peer.node}")
        except BaseException:
            writer.close()
            raise
        return Link(reader, writer, peer=peer, on_lost=self._lost)

    def _lost(self, link: Link) -> None:
        if self._links.get(link.peer.node) is link:
            del self._links[link.peer.node]
            log.warning("link to node %s lost: %s", link.peer.node, link.lost)

    def close(self) -> None:
        for link in list(self._links.values()):
            link.close("pool closed")


def client_tls_context() -> ssl.SSLContext:
    """TLS for a link: the relay's certificate is checked against the
    fingerprint the cluster's database pins for its node, not against a CA
    or a host name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # pinned instead: see _handshake
    return context


class RemoteEngineClient(AsyncEngineClient):
    """An engine on another node, reached over the link to that node's relay:
    the same client as for a local engine, another transport."""

    def __init__(self, *, name: str, pool: LinkPool, peer: Peer) -> None:
        # No port or token of its own: the relay holds the engine's.
        super().__init__(port=0, token="", name=name)
        self.pool = pool
        self.peer = peer

    def _opening(self, message: Request) -> bytes:
        return message.encoded()  # the relay authenticates to the engine

    async def _open(self, message: Request):
        data = self._opening(message)
        try:
            link = await self.pool.link(self.peer)
            return link.open(self.name, data)
        except (OSError, TimeoutError, LinkRefused, ValidationError) as error:
            raise EngineUnreachable(
                f"engine {self.name} on node {self.peer.node}: "
                f"{error or type(error).__name__}"
            ) from None


# -- the relay side ---------------------------------------------------------------


# Checks a hello: the calling node's name and secret; None when accepted, else
# why not (told to the caller).
Authenticate = Callable[[str, str], Awaitable[str | None]]
# An engine of this host by name: its loopback port and token, or None.
EngineAddress = Callable[[str], tuple[int, str] | None]


@dataclass
class _Upstream:
    """One stream as the relay holds it: its engine connection (None while
    connecting) and what arrived for it meanwhile."""

    writer: asyncio.StreamWriter | None = None
    pending: list[bytes] = field(default_factory=list)
    hung_up: bool = False
    task: asyncio.Task | None = None


class Relay:
    """The relay of one node: accepts links from the other nodes and carries
    their streams to this host's engines."""

    def __init__(
        self,
        *,
        node: str,
        authenticate: Authenticate,
        engine_address: EngineAddress,
        serving: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.node = node
        self._authenticate = authenticate
        self._engine_address = engine_address
        # Why this node takes no streams now (None: it does).
        self._serving = serving
        self._links: dict[int, tuple[str, asyncio.StreamWriter]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(
        self, host: str, port: int, *, tls: ssl.SSLContext | None = None
    ) -> None:
        self._server = await asyncio.start_server(
            self._handle, host, port, ssl=tls, reuse_address=True
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for _, writer in list(self._links.values()):
            writer.close()

    def links_of(self, node: str) -> int:
        return sum(1 for peer, _ in self._links.values() if peer == node)

    def drop_links(self, nodes: set[str]) -> None:
        """Close the links of these nodes now (revoked): their streams hang up
        on the engines, which cancel them."""
        for peer, writer in list(self._links.values()):
            if peer in nodes:
                writer.close()

    async def _handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            peer = await self._welcome(reader, writer)
        except (
            ConnectionError,
            OSError,
            TimeoutError,
            asyncio.IncompleteReadError,
            ProtocolError,  # a hello over the cap, refused from its header
        ):
            writer.close()
            return
        if peer is None:
            with contextlib.suppress(ConnectionError, OSError):
                await writer.drain()
            writer.close()
            return
        key = id(writer)
        self._links[key] = (peer, writer)
        upstreams: dict[int, _Upstream] = {}
        try:
            await self._carry(reader, writer, upstreams)
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            OSError,
            TimeoutError,
            ProtocolError,
        ):
            pass
        finally:
            self._links.pop(key, None)
            for upstream in upstreams.values():
                self._hang_up(upstream)
            writer.close()

    async def _welcome(self, reader, writer) -> str | None:
        """The calling node once its hello is checked; None (refusal sent)."""
        async with asyncio.timeout(AUTH_TIMEOUT_S):
            payload = await read_frame(reader, max_bytes=MAX_AUTH_FRAME_BYTES)
        if payload is None:
            return None
        try:
            hello = LinkHello.model_validate(decode_message(payload))
        except (ProtocolError, ValidationError):
            refusal = "not a link hello"
        else:
            refusal = self._serving() or await self._authenticate(
                hello.node, hello.secret
            )
        if refusal is not None:
            error = ErrorReply(code=ErrorCode.UNAUTHORIZED, message=refusal)
            writer.write(error.encoded())
            return None
        writer.write(encode_message(LinkWelcome(node=self.node).model_dump()))
        return hello.node

    async def _carry(self, reader, writer, upstreams: dict[int, _Upstream]) -> None:
        while True:
            async with asyncio.timeout(RELAY_DEAD_S):
                stream, kind, payload = await read_link_frame(reader)
            if kind == PING:
                writer.write(link_frame(0, PONG))
            elif kind == OPEN:
                upstream = upstreams[stream] = _Upstream()
                upstream.task = asyncio.ensure_future(
                    self._pump(stream, payload, upstream, writer, upstreams)
                )
            elif kind == DATA:
                upstream = upstreams.get(stream)
                if upstream is None or upstream.hung_up:
                    continue
                if upstream.writer is None:
                    upstream.pending.append(payload)
                else:
                    upstream.writer.write(payload)
            elif kind == CLOSE:
                upstream = upstreams.pop(stream, None)
                if upstream is not None:
                    self._hang_up(upstream)

    @staticmethod
    def _hang_up(upstream: _Upstream) -> None:
        upstream.hung_up = True
        if upstream.writer is not None:
            upstream.writer.close()

    async def _pump(
        self,
        stream: int,
        engine_name: bytes,
        upstream: _Upstream,
        link: asyncio.StreamWriter,
        upstreams: dict[int, _Upstream],
    ) -> None:
        """Connect the stream to its engine, then copy the engine's bytes to
        the link until either side ends."""
        name = engine_name.decode("utf-8", errors="replace")
        refusal = self._serving()
        if refusal is None and not ENGINE_NAME.match(name):
            refusal, name = "not an engine name", name[:64]
        address = None if refusal else self._engine_address(name)
        try:
            if address is None:
                raise OSError(refusal or f"no engine {name!r} on node {self.node}")
            port, token = address
            # Everything that arrived meanwhile goes in the same write.
            opening = auth_frame(token) + b"".join(upstream.pending)
            upstream.pending.clear()
            reader, upstream.writer = await connect_and_send(
                port, opening, timeout=CONTROL_TIMEOUT_S
            )
        except (OSError, TimeoutError) as error:
            message = ErrorReply(
                code=ErrorCode.UNREACHABLE, message=f"engine {name}: {error}"
            )
            link.write(data_frames(stream, message.encoded()))
            link.write(link_frame(stream, CLOSE))
            upstreams.pop(stream, None)
            return
        if upstream.hung_up:
            upstream.writer.close()
            return
        for chunk in upstream.pending:
            upstream.writer.write(chunk)
        upstream.pending.clear()
        try:
            while chunk := await reader.read(MAX_LINK_PAYLOAD):
                link.write(link_frame(stream, DATA, chunk))
                await link.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            upstream.writer.close()
            if upstreams.pop(stream, None) is not None:
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    link.write(link_frame(stream, CLOSE))
