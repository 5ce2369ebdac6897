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
import enum
import hmac
import io
import json
import math
import socket
import struct
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

HEADER = struct.Struct(">Q")

# Caps. A frame whose header announces more than MAX_FRAME_BYTES closes the
# connection unread: a client cannot make the engine allocate what it likes.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# A connection's first frame, its auth frame: a token (the supervisor's are 43
# characters) and its kind fit many times over.
MAX_AUTH_FRAME_BYTES = 4096
MAX_TOKEN_CHARS = 1024
# How long a new connection may take to send its auth frame (clients send it
# with their request, at once): a caller that sends nothing is dropped.
AUTH_TIMEOUT_S = 10.0
MAX_TEXTS_PER_REQUEST = 10_000
MAX_PROMPT_CHARS = 256 * 1024
MAX_MESSAGES = 1024

# Sampling bounds: one schema for the engine (every request, over the model's
# defaults), the admin (those defaults) and the REST schemas (which import these).
# A value past them used to reach llama.cpp or torch and raise in a decode thread.
MAX_SEED = 2**32 - 1  # llama.cpp's seed is a uint32
MIN_TEMPERATURE = 0.01  # 0 is greedy; logits / T overflow as T nears 0
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1000  # 0: off
MIN_REPEAT_PENALTY = 0.01  # logits are divided by it
MAX_REPEAT_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2]
MAX_TOKENS_CAP = 1 << 20
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20

# Control frames on loopback answer in well under a second; anything slower is an
# engine that is wedged or gone.
CONTROL_TIMEOUT_S = 2.0

# A generation's priority: interactive (a person or an app waiting on it) or
# batch (a Batch API line). Batch requests are admitted after interactive ones,
# leave slots free for them, and sit out a pass while an interactive prompt is
# being read (engines/generation.py, engines/slots.py).
PRIORITIES = ("interactive", "batch")

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
    # The prompt does not fit the model's context (OpenAI's code for it).
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_MODEL = "unknown_model"
    OVERLOADED = "overloaded"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    COOLING = "cooling"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    # A node's relay could not reach the engine named (engines/link.py): the
    # request never started there, and the caller tries another replica.
    UNREACHABLE = "unreachable"


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
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            if not all(_encodable(key) for key in item):
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


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def check_text(value: str, field: str) -> str:
    """A caller's text: no NUL character, and encodable as UTF-8 (JSON's `\\ud800`
    escape decodes to a lone surrogate, which is not)."""
    if "\x00" in value:
        raise _bad(f"{field} must not contain a NUL character")
    if not _encodable(value):
        raise _bad(f"{field} is not valid Unicode (a lone surrogate)")
    return value


_FLOAT_BOUNDS = {
    "temperature": (0.0, MAX_TEMPERATURE),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repeat_penalty": (MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY),
    "presence_penalty": (-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY),
}
_INT_BOUNDS = {
    "top_k": (0, MAX_TOP_K),
    "max_tokens": (1, MAX_TOKENS_CAP),
    "seed": (0, MAX_SEED),
    "top_logprobs": (0, MAX_TOP_LOGPROBS),
}
TEMPERATURE_RANGE = f"0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
SAMPLING_FIELDS = (*_FLOAT_BOUNDS, *_INT_BOUNDS, "stop", "ignore_eos", "logprobs")


def check_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields among `fields`, each checked against the bounds above
    and normalised (numbers as float or int, `stop` as a tuple); `bad_request`
    naming the field otherwise. Other keys, and fields set to None, are skipped."""
    values: dict[str, Any] = {}
    for name, (low, high) in _FLOAT_BOUNDS.items():
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(f"{name} must be a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise _bad(f"{name} must be a finite number")
        within = low <= value <= high
        if name == "temperature" and 0 < value < MIN_TEMPERATURE:
            within = False  # between greedy and the least warmth
        if not within:
            raise _bad(_out_of_range(name, value, low, high))
        values[name] = float(value)
    for name, (low, high) in _INT_BOUNDS.items():
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(f"{name} must be a whole number")
        if not low <= value <= high:
            raise _bad(_out_of_range(name, value, low, high))
        values[name] = value
    values["stop"] = _check_stop(fields.get("stop"))
    for name in ("ignore_eos", "logprobs"):
        if fields.get(name) is not None:
            if not isinstance(fields[name], bool):
                raise _bad(f"{name} must be true or false")
            values[name] = fields[name]
    return values


def _out_of_range(name: str, value: float, low: float, high: float) -> str:
    if name == "temperature":
        return f"temperature must be {TEMPERATURE_RANGE}"
    if value > high:
        return f"{name} must be at most {_number(high)}"
    if low == 1:
        return f"{name} must be positive"
    return f"{name} must be at least {_number(low)}"


def _number(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def _check_stop(stop: object) -> tuple[str, ...]:
    if stop is None or stop == [] or stop == ():
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(
        isinstance(item, str) and item for item in stop
    ):
        raise _bad("stop must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"at most {MAX_STOP_STRINGS} stop strings")
    for item in stop:
        if len(item) > MAX_STOP_CHARS:
            raise _bad(f"a stop string is at most {MAX_STOP_CHARS} characters")
        check_text(item, "stop")
    return tuple(stop)


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
    """Check a request's shape after authentication; returns its kind (a
    generate request's fields are checked by engines.generate_request)."""
    kind = _require(message, "kind", str)
    if kind not in KINDS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown kind {kind!r}")
    if kind in ("load", "unload", "embed", "generate", "generate_stream"):
        _require(message, "model", str)
    if kind in ("generate", "generate_stream"):
        # The rest of a generate request's shape: engines.generate_request.
        prompt = _require(message, "prompt", str, optional=True)
        if prompt is not None:
            check_text(prompt, "prompt")
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
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "texts must be strings")
            check_text(text, f"texts[{index}]")
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
