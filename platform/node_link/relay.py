"""The relay side of a node link (platform/node_link/protocol.py says the protocol):
accepts links from the other nodes and carries each stream to an engine of
this host on 127.0.0.1 with that engine's token (only the requests a link
may make: platform/node_link/gate.py), or, for a files stream, answers it from
this host's model files (platform/node_link/files.py).

What a peer can hold of the relay is bounded: handshakes before anyone is
authenticated (platform/node_link/admission.py), MAX_LINKS_PER_NODE links per
node (a new one closes the oldest), MAX_STREAMS_PER_LINK streams per link (a
stream beyond is answered `unreachable`: the caller tries another replica),
and MAX_LINK_HELD_BYTES of what a link's streams sent and their engines have
not read yet (a link over it is dropped). A stream id opened twice, or any
other break of the protocol, drops the link. Nothing a peer sends ends the
relay: an error no one expected drops that link and is logged.
"""

import asyncio
import contextlib
import hashlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from engines.wire.bounds import CONTROL_TIMEOUT_S, MAX_AUTH_FRAME_BYTES
from engines.wire.client import connect_and_send
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.framing import (
    HEADER,
    auth_frame,
    decode_message,
    encode_message,
    read_frame,
)
from engines.wire.replies import ErrorReply
from node_link.admission import (
    HANDSHAKE_S,
    MAX_LOOKUPS,
    REFUSED,
    FailedHellos,
    Handshakes,
    RefusalLog,
)
from node_link.files import FILES_STREAM, MAX_REQUEST_BYTES, FileServer
from node_link.gate import RequestGate
from node_link.protocol import (
    CLOSE,
    DATA,
    DATABASE_REACHED,
    DATABASE_UNREACHED,
    ENGINE_NAME,
    MAX_LINK_PAYLOAD,
    OPEN,
    PING,
    PONG,
    RELAY_DEAD_S,
    LinkHello,
    LinkWelcome,
    certificate_names,
    data_frames,
    link_frame,
    read_link_frame,
)

log = logging.getLogger("roundhouse.relay")

MAX_LINKS_PER_NODE = 8
MAX_STREAMS_PER_LINK = 128
MAX_LINK_HELD_BYTES = 64 * 1024 * 1024


def link_proof(secret: str) -> str:
    """What a link's node proved itself with, as the cluster stores a node
    secret (its SHA-256, hex): a link whose node's stored secret is no longer
    this is closed (NodeRelay.recheck)."""
    return hashlib.sha256(secret.encode("utf-8", errors="replace")).hexdigest()


def _certificate_refusal(writer: asyncio.StreamWriter, node: str) -> str | None:
    """In mutual TLS (a private CA), the caller's certificate must name the
    node its hello speaks for; None when it does or the link has none."""
    ssl_object = writer.get_extra_info("ssl_object")
    peercert = ssl_object.getpeercert() if ssl_object is not None else None
    if not peercert:
        return None
    if node not in certificate_names(peercert):
        return f"the link's certificate is not node {node!r}'s"
    return None


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
    # A files stream's request as it arrives (None: an engine stream).
    inbox: asyncio.StreamReader | None = None
    inbox_bytes: int = 0
    # An engine stream's requests, checked whole before they are sent on.
    gate: RequestGate = field(default_factory=RequestGate)

    @property
    def held(self) -> int:
        """Bytes of this stream the relay holds: a request not yet whole,
        what waits for the engine connection, what the engine has not read
        (a files stream's request is capped on its own)."""
        held = self.gate.held + sum(len(chunk) for chunk in self.pending)
        if self.writer is not None and self.writer.transport is not None:
            held += self.writer.transport.get_write_buffer_size()
        return held


@dataclass
class _Link:
    """An accepted link: its node, what the node proved itself with, and
    its connection."""

    node: str
    proof: str
    writer: asyncio.StreamWriter


class NodeRelay:
    """The relay of one node: accepts links from the other nodes and carries
    their streams to this host's engines."""

    def __init__(
        self,
        *,
        node: str,
        authenticate: Authenticate,
        engine_address: EngineAddress,
        serving: Callable[[], str | None] = lambda: None,
        database: Callable[[], bool] = lambda: True,
        files: FileServer | None = None,
    ) -> None:
        self.node = node
        self._files = files
        self._authenticate = authenticate
        self._engine_address = engine_address
        # Why this node takes no streams now (None: it does). Links are
        # welcomed either way (a node that cannot confirm its place still
        # tells its peers so, in its PONGs: `database`, whether it reaches
        # the cluster's database now).
        self._serving = serving
        self._database = database
        self._links: dict[int, _Link] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tls: ssl.SSLContext | None = None
        self.handshakes = Handshakes()
        self._failed = FailedHellos()
        self._refusals = RefusalLog()
        self._lookups = asyncio.Semaphore(MAX_LOOKUPS)

    async def start(
        self, host: str, port: int, *, tls: ssl.SSLContext | None = None
    ) -> None:
        # TLS is started per connection, once the connection is admitted
        # (Handshakes): a handshake is bounded like the hello after it.
        self._tls = tls
        self._server = await asyncio.start_server(
            self._handle, host, port, reuse_address=True
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links.values()):
            link.writer.close()

    def links_of(self, node: str) -> int:
        return sum(1 for link in self._links.values() if link.node == node)

    def linked_nodes(self) -> set[str]:
        return {link.node for link in list(self._links.values())}

    def recheck(self, proofs: Mapping[str, str]) -> None:
        """Close every link whose node is not in `proofs` (node -> the
        secret it must have proved itself with: link_proof) or proved itself
        with another secret: a node deleted, revoked or joined again since."""
        for link in list(self._links.values()):
            if proofs.get(link.node) != link.proof:
                log.warning(
                    "relay closed a link of node %s: that node is no longer "
                    "the one that opened it (deleted, revoked or joined again)",
                    link.node,
                )
                link.writer.close()

    async def _handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            await self._serve_link(reader, writer)
        except Exception as error:  # noqa: BLE001 - that link alone ends
            peername = writer.get_extra_info("peername")
            self._refusals.refused(
                str(peername[0]) if peername else "?",
                f"dropped on an unexpected error ({type(error).__name__}: {error})",
            )
        finally:
            writer.close()

    async def _serve_link(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peername = writer.get_extra_info("peername")
        address = str(peername[0]) if peername else "?"
        if not self.handshakes.enter(address):
            self._refusals.refused(address, "too many links being set up")
            writer.transport.abort()
            return
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                if self._tls is not None:
                    await writer.start_tls(self._tls, ssl_handshake_timeout=HANDSHAKE_S)
                welcomed = await self._welcome(reader, writer, address)
        except (
            ConnectionError,
            OSError,
            TimeoutError,
            asyncio.IncompleteReadError,
            ProtocolError,  # a hello over the cap, refused from its header
        ) as error:
            self._refusals.refused(address, f"no hello ({type(error).__name__})")
            return
        finally:
            self.handshakes.leave(address)
        if welcomed is None:
            with contextlib.suppress(ConnectionError, OSError):
                async with asyncio.timeout(HANDSHAKE_S):
                    await writer.drain()
            return
        link = _Link(*welcomed, writer)
        others = [key for key, held in self._links.items() if held.node == link.node]
        for key in others[: max(0, len(others) - MAX_LINKS_PER_NODE + 1)]:
            self._links[key].writer.close()  # the oldest: a node reconnecting
        key = id(writer)
        self._links[key] = link
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

    async def _welcome(self, reader, writer, address: str) -> tuple[str, str] | None:
        """The calling node and its proof once its hello is checked; None
        (the refusal written: the same for every reason)."""
        payload = await read_frame(reader, max_bytes=MAX_AUTH_FRAME_BYTES)
        if payload is None:
            return None
        try:
            hello = LinkHello.model_validate(decode_message(payload))
        except (ProtocolError, ValidationError):
            hello, why = None, "not a link hello"
        else:
            why = _certificate_refusal(writer, hello.node)
        if hello is not None and why is None:
            if self._failed.throttled(address):
                why = "too many failed hellos from this address lately"
            else:
                async with self._lookups:
                    why = await self._authenticate(hello.node, hello.secret)
                if why is not None:
                    self._failed.failed(address)
        elif hello is None:
            self._failed.failed(address)
        if why is not None:
            self._refusals.refused(address, why)
            writer.write(
                ErrorReply(code=ErrorCode.UNAUTHORIZED, message=REFUSED).encoded()
            )
            return None
        writer.write(encode_message(LinkWelcome(node=self.node).model_dump()))
        return hello.node, link_proof(hello.secret)

    async def _carry(self, reader, writer, upstreams: dict[int, _Upstream]) -> None:
        while True:
            async with asyncio.timeout(RELAY_DEAD_S):
                stream, kind, payload = await read_link_frame(reader)
            if kind == PING:
                reached = DATABASE_REACHED if self._database() else DATABASE_UNREACHED
                writer.write(link_frame(0, PONG, reached))
            elif kind == OPEN:
                self._open(stream, payload, writer, upstreams)
            elif kind == DATA:
                upstream = upstreams.get(stream)
                if upstream is None or upstream.hung_up:
                    continue
                if upstream.inbox is not None:
                    # One request frame is all a files stream carries: more
                    # than its cap is not kept (the request then fails).
                    room = MAX_REQUEST_BYTES + HEADER.size - upstream.inbox_bytes
                    upstream.inbox_bytes += len(payload)
                    if room > 0:
                        upstream.inbox.feed_data(payload[:room])
                    continue
                try:
                    data = upstream.gate.feed(payload)
                except ProtocolError as refused:
                    self._refuse(stream, refused, writer, upstreams)
                    continue
                if upstream.writer is None:
                    upstream.pending.append(data)
                elif data:
                    upstream.writer.write(data)
                held = sum(each.held for each in upstreams.values())
                if held > MAX_LINK_HELD_BYTES:
                    raise ProtocolError(
                        ErrorCode.OVERLOADED,
                        f"the link's streams hold {held} bytes their engines "
                        f"have not read, over the cap of {MAX_LINK_HELD_BYTES}",
                    )
            elif kind == CLOSE:
                upstream = upstreams.pop(stream, None)
                if upstream is not None:
                    self._hang_up(upstream)

    def _open(
        self,
        stream: int,
        payload: bytes,
        writer: asyncio.StreamWriter,
        upstreams: dict[int, _Upstream],
    ) -> None:
        """Start stream `stream`: to the engine `payload` names, or files."""
        if stream in upstreams:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"stream {stream} opened while open"
            )
        if len(upstreams) >= MAX_STREAMS_PER_LINK:
            refusal = ErrorReply(
                code=ErrorCode.UNREACHABLE,
                message=f"node {self.node}: a link carries at most "
                f"{MAX_STREAMS_PER_LINK} streams at once",
            )
            writer.write(data_frames(stream, refusal.encoded()))
            writer.write(link_frame(stream, CLOSE))
            return
        if payload == FILES_STREAM.encode():
            upstream = upstreams[stream] = _Upstream(inbox=asyncio.StreamReader())
            upstream.task = asyncio.ensure_future(
                self._serve_files(stream, upstream, writer, upstreams)
            )
        else:
            upstream = upstreams[stream] = _Upstream()
            upstream.task = asyncio.ensure_future(
                self._pump(stream, payload, upstream, writer, upstreams)
            )

    def _refuse(
        self,
        stream: int,
        refused: ProtocolError,
        writer: asyncio.StreamWriter,
        upstreams: dict[int, _Upstream],
    ) -> None:
        """Answer a stream that sent what a link does not carry, and close it
        (its engine connection hung up: nothing after it reaches the engine)."""
        upstream = upstreams.pop(stream, None)
        if upstream is not None:
            self._hang_up(upstream)
        writer.write(data_frames(stream, ErrorReply.of(refused).encoded()))
        writer.write(link_frame(stream, CLOSE))

    @staticmethod
    def _hang_up(upstream: _Upstream) -> None:
        upstream.hung_up = True
        if upstream.writer is not None:
            upstream.writer.close()
        if upstream.inbox is not None and upstream.task is not None:
            upstream.task.cancel()

    async def _serve_files(
        self,
        stream: int,
        upstream: _Upstream,
        link: asyncio.StreamWriter,
        upstreams: dict[int, _Upstream],
    ) -> None:
        """Answer a files stream's one request, then close it."""
        refusal = self._serving()
        try:
            if refusal is None and self._files is None:
                refusal = f"node {self.node} does not serve model files"
            if refusal is not None:
                answer = ErrorReply(code=ErrorCode.UNREACHABLE, message=refusal)
                link.write(data_frames(stream, answer.encoded()))
                await link.drain()
            else:
                async with asyncio.timeout(CONTROL_TIMEOUT_S):
                    request = await read_frame(
                        upstream.inbox, max_bytes=MAX_REQUEST_BYTES
                    )
                # Answered, written and drained, with what a link holds capped.
                await self._files.reply(stream, request or b"", link)
        except (ConnectionError, OSError, TimeoutError, ProtocolError):
            pass
        finally:
            if upstreams.pop(stream, None) is not None:
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    link.write(link_frame(stream, CLOSE))

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
