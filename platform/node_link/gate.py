"""What a link may ask of an engine, checked in the relay.

A stream of a link is an engine connection, but not one with the engine's
full rights: the relay adds the engine's token, so whatever crosses it would
run as the supervisor's own request. A peer gets only what a front needs of a
remote engine: inference and its reads (generate, generate_stream, embed,
rerank, tokenize, detokenize), cancel, ping and
state, and the dashboard's load and unload of a catalog model by name (the
engine looks the name up in the models its supervisor configured: no path
crosses). `configure` (which sets model paths) and `shutdown` never do.

The relay cuts each stream's bytes into engine-protocol frames
(engines/wire/framing.py: an 8-byte length, then the payload), reads every
frame with the engine's own typed schema (engines/wire/requests.py) and
forwards it only whole and only if its kind is allowed. A frame is held until
it is whole, up to MAX_LINK_REQUEST_BYTES (refused from its header, before
anything of it is kept).
"""

from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.framing import HEADER, decode_message
from engines.wire.requests import (
    CancelRequest,
    DetokenizeRequest,
    EmbedRequest,
    GenerateRequest,
    LoadRequest,
    PingRequest,
    RerankRequest,
    StateRequest,
    TokenizeRequest,
    UnloadRequest,
    parse_request,
)

# The request types a link carries (every other kind is refused).
LINK_REQUESTS = (
    PingRequest,
    StateRequest,
    LoadRequest,
    UnloadRequest,
    EmbedRequest,
    RerankRequest,
    TokenizeRequest,
    DetokenizeRequest,
    GenerateRequest,
    CancelRequest,
)
# One request frame as a link carries it (the largest a front sends: an embed
# of many texts; a generate request is capped at 4 MiB).
MAX_LINK_REQUEST_BYTES = 32 * 1024 * 1024


class LinkForbidden(ProtocolError):
    """A stream asked for what a link does not carry (or sent what is not a
    request): the relay answers it with this and closes the stream."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHORIZED, message)


class RequestGate:
    """One stream's bytes from the caller, let through a whole allowed
    request at a time. `feed` raises ProtocolError (LinkForbidden, or the
    engine's own bad_request for a frame that is no request): the relay
    answers the stream with it and closes it."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def held(self) -> int:
        """Bytes kept of a request not yet whole."""
        return len(self._buffer)

    def feed(self, data: bytes) -> bytes:
        """The bytes of the requests `data` completes, checked (LinkForbidden
        for one a link does not carry: nothing after it is forwarded)."""
        buffer = self._buffer
        buffer += data
        allowed = bytearray()
        while len(buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer)
            if size > MAX_LINK_REQUEST_BYTES:
                buffer.clear()
                raise LinkForbidden(
                    f"a request of {size} bytes is over a link's cap of "
                    f"{MAX_LINK_REQUEST_BYTES}"
                )
            end = HEADER.size + size
            if len(buffer) < end:
                break
            payload = bytes(buffer[HEADER.size : end])
            _check(payload)
            allowed += buffer[:end]
            del buffer[:end]
        return bytes(allowed)


def _check(payload: bytes) -> None:
    """Nothing when `payload` is a request a link carries; LinkForbidden for a
    kind it does not, the engine's own error (bad_request) for a frame that is
    no request."""
    message = decode_message(payload)
    kind = message.get("kind")
    if kind in ("configure", "shutdown"):
        raise LinkForbidden(f"a link may not send {kind!r} to an engine")
    request = parse_request(message, size=len(payload))
    if not isinstance(request, LINK_REQUESTS):
        raise LinkForbidden(f"a link may not send {request.kind!r} to an engine")
