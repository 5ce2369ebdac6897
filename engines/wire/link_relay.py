"""The relay side of a node link (engines/wire/link.py says the protocol):
accepts links from the other nodes and carries each stream, byte for byte, to
an engine of this host on 127.0.0.1 with that engine's token, or, for a files
stream, answers it from this host's model files (engines/wire/link_files.py)."""

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from engines.wire.bounds import AUTH_TIMEOUT_S, CONTROL_TIMEOUT_S, MAX_AUTH_FRAME_BYTES
from engines.wire.client import connect_and_send
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.frames import ErrorReply
from engines.wire.framing import (
    HEADER,
    auth_frame,
    decode_message,
    encode_message,
    read_frame,
)
from engines.wire.link import (
    CLOSE,
    DATA,
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
from engines.wire.link_files import FILES_STREAM, MAX_REQUEST_BYTES, FileServer


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
        files: FileServer | None = None,
    ) -> None:
        self.node = node
        self._files = files
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
            refusal = (
                self._serving()
                or _certificate_refusal(writer, hello.node)
                or await self._authenticate(hello.node, hello.secret)
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
            elif kind == OPEN and payload == FILES_STREAM.encode():
                upstream = upstreams[stream] = _Upstream(inbox=asyncio.StreamReader())
                upstream.task = asyncio.ensure_future(
                    self._serve_files(stream, upstream, writer, upstreams)
                )
            elif kind == OPEN:
                upstream = upstreams[stream] = _Upstream()
                upstream.task = asyncio.ensure_future(
                    self._pump(stream, payload, upstream, writer, upstreams)
                )
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
                elif upstream.writer is None:
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
                reply = answer.encoded()
            else:
                async with asyncio.timeout(CONTROL_TIMEOUT_S):
                    request = await read_frame(
                        upstream.inbox, max_bytes=MAX_REQUEST_BYTES
                    )
                reply = await self._files.answer(request or b"")
            link.write(data_frames(stream, reply))
            await link.drain()
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
