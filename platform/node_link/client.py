"""The client side of a node link (platform/node_link/protocol.py says the protocol):
a pool of links, one per peer node, and `RemoteEngineClient`, the engine
client whose connection is a stream on a link instead of a socket."""

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engines.wire.bounds import CONTROL_TIMEOUT_S, MAX_AUTH_FRAME_BYTES
from engines.wire.client import AsyncEngineClient, EngineUnreachable
from engines.wire.errors import ProtocolError
from engines.wire.framing import decode_message, encode_message, read_frame
from engines.wire.replies import ErrorReply
from engines.wire.requests import Request
from node_link.protocol import (
    CLOSE,
    CONNECT_COOLDOWN_S,
    DATA,
    DATABASE_UNREACHED,
    LINK_DEAD_S,
    LINK_PING_S,
    MAX_LINK_PAYLOAD,
    MAX_STREAM_ID,
    OPEN,
    PING,
    PONG,
    WELCOME,
    LinkHello,
    LinkRefused,
    PrivateCa,
    certificate_fingerprint,
    certificate_names,
    data_frames,
    link_frame,
    read_link_frame,
)

log = logging.getLogger("roundhouse.link")


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
        self._last_id = 0
        self._heard_at = time.monotonic()
        self.lost: str | None = None
        # Whether the peer's node reaches the cluster's database, as its last
        # PONG said (None before the first).
        self.peer_database: bool | None = None
        self._tasks = [
            asyncio.ensure_future(self._read_loop()),
            asyncio.ensure_future(self._keepalive()),
        ]

    @property
    def alive(self) -> bool:
        """Not lost, and the peer was heard from within LINK_DEAD_S."""
        return self.lost is None and time.monotonic() - self._heard_at <= LINK_DEAD_S

    def open(self, engine: str, data: bytes) -> tuple[asyncio.StreamReader, Any]:
        """A new stream to `engine` on the peer, with `data` sent on it."""
        if self.lost is not None:
            raise ConnectionResetError(f"link to node {self.peer.node} lost")
        stream = self._next_id()
        reader = asyncio.StreamReader(limit=MAX_LINK_PAYLOAD * 2)
        self._streams[stream] = reader
        self.send(
            link_frame(stream, OPEN, engine.encode("utf-8")) + data_frames(stream, data)
        )
        return reader, StreamWriter(self, stream)

    def _next_id(self) -> int:
        """A stream id no open stream has: after MAX_STREAM_ID, ids start
        again at 1 (0 is the link's own, for pings)."""
        while True:
            self._last_id = self._last_id % MAX_STREAM_ID + 1
            if self._last_id not in self._streams:
                return self._last_id

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
                elif kind == PONG:
                    self.peer_database = payload != DATABASE_UNREACHED
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
    """The links of one event loop, one per peer node, made on first use.
    With a private CA, every link is mutual TLS under it; else TLS with the
    peer's pinned certificate. A peer that has none is reached in plain TCP
    only where `plain_tcp` allows it (a cluster whose links are plain:
    ROUNDHOUSE_CLUSTER_TLS off); else it is refused before anything is sent,
    so this node's secret never travels in clear text to an address someone
    set on a row."""

    def __init__(
        self,
        *,
        node: str,
        secret: str,
        ca: PrivateCa | None = None,
        plain_tcp: bool = False,
    ) -> None:
        self.node = node
        self.plain_tcp = plain_tcp
        self._secret = secret
        self._ca_context = client_tls_context(ca) if ca is not None else None
        self._links: dict[str, Link] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._failed: dict[str, tuple[float, str]] = {}
        self._closed = False

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
            raise ConnectionRefusedError(f"{failed[1]} (just now)")
        pending = self._connecting.get(peer.node)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(peer))
            self._connecting[peer.node] = pending
            pending.add_done_callback(functools.partial(self._connected, peer.node))
        return await asyncio.shield(pending)

    def _connected(self, node: str, attempt: asyncio.Future) -> None:
        """A connection attempt ended: its error is taken here (every caller
        may have stopped waiting for it), not reported as never retrieved."""
        self._connecting.pop(node, None)
        if not attempt.cancelled():
            attempt.exception()

    async def _connect(self, peer: Peer) -> Link:
        try:
            link = await asyncio.wait_for(self._handshake(peer), CONTROL_TIMEOUT_S)
        except (OSError, TimeoutError, LinkRefused) as error:
            why = str(error) or "timed out"
            if not why.startswith(f"node {peer.node}"):
                why = f"node {peer.node}: {why}"
            self._failed[peer.node] = (time.monotonic(), why)
            raise
        self._failed.pop(peer.node, None)
        old = self._links.get(peer.node)
        if old is not None:
            old.close("replaced")
        self._links[peer.node] = link
        return link

    async def _handshake(self, peer: Peer) -> Link:
        context = self._ca_context
        if context is None and peer.tls_fingerprint:
            context = client_tls_context()
        if context is None and not self.plain_tcp:
            raise LinkRefused(
                f"node {peer.node} has no TLS certificate on record, and this "
                "node's links use TLS: its secret is not sent in clear text "
                "(the node's supervisor publishes one when it starts with "
                "ROUNDHOUSE_CLUSTER_TLS on)"
            )
        try:
            reader, writer = await asyncio.open_connection(
                peer.host, peer.port, ssl=context
            )
        except ssl.SSLCertVerificationError as error:
            raise LinkRefused(
                f"node {peer.node}: the relay's certificate is not signed by the "
                f"cluster's CA ({error.verify_message})"
            ) from None
        try:
            if self._ca_context is not None:
                names = certificate_names(
                    writer.get_extra_info("ssl_object").getpeercert()
                )
                if peer.node not in names:
                    raise LinkRefused(
                        f"node {peer.node}: the relay's certificate is for "
                        f"{', '.join(sorted(names)) or 'no name'}, not this node"
                    )
            elif context is not None:
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
            if not self._closed:
                log.warning("link to node %s lost: %s", link.peer.node, link.lost)

    def close(self) -> None:
        self._closed = True
        for link in list(self._links.values()):
            link.close("pool closed")


def client_tls_context(ca: PrivateCa | None = None) -> ssl.SSLContext:
    """TLS for a link. Without a CA, the relay's certificate is checked against
    the fingerprint the cluster's database pins for its node (see
    _handshake). With one, it must be signed by the CA and name the node (the
    name is checked in _handshake: a node name is not a host name), and this
    node presents its own certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    if ca is None:
        context.verify_mode = ssl.CERT_NONE  # pinned instead
        return context
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cafile=ca.ca)
    context.load_cert_chain(ca.cert, ca.key)
    return context


class NodeUnreachable(EngineUnreachable):
    """No link to the engine's node could be made (or it was lost): every
    engine of that node is out of reach from here, not only this one."""

    def __init__(self, message: str, *, node: str) -> None:
        super().__init__(message)
        self.node = node


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
            raise NodeUnreachable(
                f"engine {self.name} on node {self.peer.node}: "
                f"{error or type(error).__name__}",
                node=self.peer.node,
            ) from None
