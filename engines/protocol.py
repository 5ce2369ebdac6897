"""The framed protocol spoken between engines and their clients.

A frame is an 8-byte big-endian length followed by that many bytes. A message is
one frame holding a UTF-8 JSON object. An array (embeddings) travels either inside
the JSON as lists, or as one extra frame right after its message holding a `.npy`
payload written with allow_pickle=False. Nothing is ever pickled. Every length is
checked against the cap from the header alone, before a buffer is allocated.
"""

import asyncio
import enum
import io
import json
import socket
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

HEADER = struct.Struct(">Q")

# Caps. A frame whose header announces more than MAX_FRAME_BYTES closes the
# connection unread: a client cannot make the engine allocate what it likes.
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_TEXTS_PER_REQUEST = 10_000
MAX_PROMPT_CHARS = 256 * 1024

# Control frames on loopback answer in well under a second; anything slower is an
# engine that is wedged or gone.
CONTROL_TIMEOUT_S = 2.0

KINDS = (
    "ping",
    "state",
    "load",
    "unload",
    "embed",
    "generate",
    "generate_stream",
    "cancel",
    "configure",
    "shutdown",
)


class ErrorCode(enum.StrEnum):
    """Stable error codes; the front maps each to one HTTP status."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_MODEL = "unknown_model"
    OVERLOADED = "overloaded"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    COOLING = "cooling"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A request that cannot be served, carried back as an error frame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message

    def as_frame(self) -> dict[str, str]:
        return error_frame(self.code, self.message)


class FrameTooLarge(ProtocolError):
    """The header announced more bytes than the cap: the connection is closed."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            ErrorCode.BAD_REQUEST, f"frame of {size} bytes exceeds the {limit} cap"
        )


def error_frame(code: ErrorCode | str, message: str) -> dict[str, str]:
    return {"status": "error", "code": str(code), "message": message}


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
    """Parse a frame's payload; anything but a JSON object is a bad request."""
    try:
        message = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed JSON: {error}") from None
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a message must be a JSON object")
    return message


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


def split_frames(data: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> Iterator[bytes]:
    """Payloads of the complete frames in a buffer; a partial tail is an error."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < HEADER.size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "truncated header")
        size = frame_length(data[offset : offset + HEADER.size], max_bytes=max_bytes)
        offset += HEADER.size
        if len(data) - offset < size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "truncated frame")
        yield data[offset : offset + size]
        offset += size


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


async def read_message(
    reader: asyncio.StreamReader, *, max_bytes: int = MAX_FRAME_BYTES
) -> dict[str, Any] | None:
    payload = await read_frame(reader, max_bytes=max_bytes)
    return None if payload is None else decode_message(payload)


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


def recv_message(
    sock: socket.socket, *, max_bytes: int = MAX_FRAME_BYTES
) -> dict[str, Any]:
    return decode_message(recv_frame(sock, max_bytes=max_bytes))


# -- request validation -----------------------------------------------------------


def _require(message: dict, key: str, kind: type | tuple, *, optional: bool = False):
    if key not in message:
        if optional:
            return None
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"missing field {key!r}")
    value = message[key]
    if isinstance(value, bool) and kind is not bool:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {key!r} has the wrong type")
    if not isinstance(value, kind):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {key!r} has the wrong type")
    return value


def validate_request(message: dict[str, Any]) -> str:
    """Check a request's shape after authentication; returns its kind."""
    kind = _require(message, "kind", str)
    if kind not in KINDS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown kind {kind!r}")
    if kind in ("load", "unload", "embed", "generate", "generate_stream"):
        _require(message, "model", str)
    if kind in ("generate", "generate_stream"):
        if ("prompt" in message) == ("messages" in message):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "send exactly one of `prompt` and `messages`"
            )
        _require(message, "prompt", str, optional=True)
        _require(message, "messages", list, optional=True)
        _require(message, "request_id", str, optional=True)
    if kind == "cancel":
        _require(message, "request_id", str)
    if kind == "embed":
        texts = _require(message, "texts", list)
        if not texts:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "texts is empty")
        if len(texts) > MAX_TEXTS_PER_REQUEST:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{len(texts)} texts exceed the cap of {MAX_TEXTS_PER_REQUEST}",
            )
        for text in texts:
            if not isinstance(text, str):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "texts must be strings")
            if len(text) > MAX_PROMPT_CHARS:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"a text of {len(text)} characters exceeds the cap of "
                    f"{MAX_PROMPT_CHARS}",
                )
        encoding = _require(message, "encoding", str, optional=True)
        if encoding not in (None, "json", "npy"):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "encoding is json or npy")
    if kind == "configure":
        _require(message, "config", dict)
    return kind
