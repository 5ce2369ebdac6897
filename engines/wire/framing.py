"""The framed protocol spoken between engines and their clients.

A frame is an 8-byte big-endian length followed by that many bytes. A message is
one frame holding a UTF-8 JSON object. An array (embeddings) travels either inside
the JSON as lists, or as one extra frame right after its message holding a `.npy`
payload written with allow_pickle=False. Nothing is ever pickled. Every length is
checked against the cap from the header alone, before a buffer is allocated.

A connection opens with an auth frame (`Auth`: {"kind": "auth", "token": ...}),
read under a cap of MAX_AUTH_FRAME_BYTES: until its token is checked, the
engine reads nothing larger, so a caller without the token cannot make it
read or decode a large frame. A wrong or missing one is answered
`unauthorized` and the connection closed. Requests follow on the same
connection without a token of their own (clients send the auth frame and the
request in one write: no round trip is added).
"""

import asyncio
import hmac
import io
import json
import socket
import struct
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.wire.bounds import (
    MAX_AUTH_FRAME_BYTES,
    MAX_FRAME_BYTES,
    MAX_TOKEN_CHARS,
    encodable,
)
from engines.wire.errors import ErrorCode, FrameTooLarge, ProtocolError

HEADER = struct.Struct(">Q")


class Auth(BaseModel):
    """A connection's first frame: the engine's token (unknown keys refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["auth"]
    token: str = Field(min_length=1, max_length=MAX_TOKEN_CHARS)


UNAUTHORIZED_MESSAGE = "missing or wrong token"


def auth_frame(token: str) -> bytes:
    """The frame a connection opens with."""
    # Not validated here: a bad token is the engine's to refuse.
    message = {"kind": "auth", "token": token}
    return encode_message(message, max_bytes=MAX_AUTH_FRAME_BYTES)


def check_auth(payload: bytes, token: bytes) -> None:
    """A connection's first frame's payload holds `token`; `unauthorized`
    otherwise (whatever is wrong with it: the caller learns nothing more)."""
    try:
        auth = Auth.model_validate(decode_message(payload))
    except (ProtocolError, ValidationError):
        raise ProtocolError(ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE) from None
    if not hmac.compare_digest(auth.token.encode("utf-8"), token):
        raise ProtocolError(ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)


# -- encoding ---------------------------------------------------------------


def frame_bytes(payload: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Prefix a payload with its length."""
    if len(payload) > max_bytes:
        raise FrameTooLarge(len(payload), max_bytes)
    return HEADER.pack(len(payload)) + payload


def encode_message(
    message: dict[str, Any], *, max_bytes: int = MAX_FRAME_BYTES
) -> bytes:
    """One JSON object as one frame."""
    payload = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    return frame_bytes(payload.encode("utf-8"), max_bytes=max_bytes)


def decode_message(payload: bytes) -> dict[str, Any]:
    """Parse a frame's payload; anything but a JSON object is a bad request, and
    so is a string that could not be encoded back (a lone surrogate escape)."""
    try:
        message = json.loads(payload.decode("utf-8"))
    except ValueError as error:  # bad UTF-8 or JSON, an integer of 4300+ digits
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed JSON: {error}") from None
    except RecursionError:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "malformed JSON: nested too deeply"
        ) from None
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a message must be a JSON object")
    # A lone surrogate can only come from a \uD800-\uDFFF escape: look for one
    # only when the bytes hold such an escape.
    if b"\\ud" in payload or b"\\uD" in payload:
        path = find_lone_surrogate(message)
        if path is not None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{_dotted(path) or 'a key of the message'} is not valid Unicode "
                "(a lone surrogate)",
            )
    return message


def find_lone_surrogate(value: Any) -> tuple[str | int, ...] | None:
    """The keys and indexes down to the first string UTF-8 cannot encode (a lone
    surrogate, which JSON's `\\ud800` escape decodes to), or None. A bad key
    is reported as the path of its object."""
    pending: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if not encodable(item):
                return path
        elif isinstance(item, dict):
            if not all(encodable(key) for key in item):
                return path
            pending.extend(reversed([(v, (*path, k)) for k, v in item.items()]))
        elif isinstance(item, list):
            pending.extend(reversed([(v, (*path, i)) for i, v in enumerate(item)]))
    return None


def _dotted(path: tuple[str | int, ...]) -> str:
    """A path as `messages[0].content`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def encode_array(array: np.ndarray) -> bytes:
    """An array as a .npy payload (never pickled)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def decode_array(payload: bytes) -> np.ndarray:
    """A .npy payload back to an array; object arrays are refused."""
    try:
        return np.load(io.BytesIO(payload), allow_pickle=False)
    except ValueError as error:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad array: {error}") from None


def frame_length(header: bytes, *, max_bytes: int) -> int:
    """The length a header announces, refused above the cap."""
    (size,) = HEADER.unpack(header)
    if size > max_bytes:
        raise FrameTooLarge(size, max_bytes)
    return size


# -- asyncio streams ----------------------------------------------------------


async def read_frame(
    reader: asyncio.StreamReader, *, max_bytes: int = MAX_FRAME_BYTES
) -> bytes | None:
    """The next frame's payload, or None on a clean end of stream."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as error:
        if error.partial:
            raise ConnectionError("connection closed inside a frame header") from None
        return None
    size = frame_length(header, max_bytes=max_bytes)
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ConnectionError("connection closed inside a frame") from None


# -- blocking sockets -----------------------------------------------------------


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed inside a frame")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The next frame's payload from a blocking socket."""
    size = frame_length(_recv_exactly(sock, HEADER.size), max_bytes=max_bytes)
    return _recv_exactly(sock, size)
