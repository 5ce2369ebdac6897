"""One line of a batch's input file: how a file is split into lines (one
function, for the upload's count and the worker's reading), its typed shape
(unknown keys refused), and the records the output and error files hold, in
OpenAI's shapes."""

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "MalformedLine",
    "Oversized",
    "custom_id_of",
    "input_lines",
    "RequestLine",
    "error_record",
    "failure_record",
    "output_record",
    "read_line",
]


# How much of an oversized line is read at a time while it is skipped.
SKIP_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Oversized:
    """A line longer than the cap: only its size was kept, not its bytes."""

    size: int


def input_lines(handle: BinaryIO, *, max_bytes: int) -> Iterator[bytes | Oversized]:
    """The lines of a batch input file (JSONL), in order, read one at a time.

    A line ends at a newline (LF) only: a bare carriage return (CR) is part of
    its line (JSON reads it as whitespace), the CR of a CRLF ending is dropped,
    and a last line without its LF counts. A line over `max_bytes` is an
    `Oversized`, read past a chunk at a time: memory stays bounded by the cap
    whatever the file holds. The upload's line count and the worker's reading
    both split here, so a batch has the lines its upload counted."""
    while True:
        line = handle.readline(max_bytes + 2)  # room for a CRLF ending
        if not line:
            return
        if not line.endswith(b"\n") and len(line) == max_bytes + 2:
            # Longer than the cap: read on to its end without keeping it.
            size, tail = len(line), line[-1:]
            while chunk := handle.readline(SKIP_CHUNK_BYTES):
                size += len(chunk)
                if chunk.endswith(b"\n"):
                    size -= 1 + ((tail + chunk)[-2:-1] == b"\r")
                    break
                tail = chunk[-1:]
            yield Oversized(size)
            continue
        if line.endswith(b"\n"):
            line = line[:-1]
            if line.endswith(b"\r"):
                line = line[:-1]
        if len(line) > max_bytes:
            yield Oversized(len(line))
        else:
            yield line


def count_lines(handle: BinaryIO) -> int:
    """How many lines `input_lines` reads in the file."""
    return sum(1 for _ in input_lines(handle, max_bytes=SKIP_CHUNK_BYTES))


class RequestLine(BaseModel):
    """`{"custom_id", "method": "POST", "url", "body"}`; the body is checked
    later by the endpoint's own schema (api.schemas), as a live request is."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass
class MalformedLine(Exception):
    """A line that is not a request of the batch: it goes to the error file."""

    custom_id: str
    message: str


def read_line(raw: bytes | Oversized, *, endpoint: str, max_bytes: int) -> RequestLine:
    """The request on one line of the input file (MalformedLine otherwise:
    over the size cap, not JSON, not the line shape, or for another endpoint
    than the batch's)."""
    size = raw.size if isinstance(raw, Oversized) else len(raw)
    if isinstance(raw, Oversized) or size > max_bytes:
        raise MalformedLine("", f"The line has {size} bytes; the cap is {max_bytes}.")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MalformedLine("", f"The line is not valid JSON: {error}.") from None
    custom_id = _custom_id_in(data)
    try:
        line = RequestLine.model_validate(data)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"]) or "line"
        raise MalformedLine(custom_id, f"{where}: {problem['msg']}.") from None
    if line.url != endpoint:
        raise MalformedLine(
            custom_id,
            f"The line's url is {line.url}; this batch's endpoint is {endpoint}.",
        )
    return line


def custom_id_of(raw: bytes | Oversized) -> str:
    """A line's custom_id where it has one ("" otherwise), whatever else is
    wrong with it."""
    if isinstance(raw, Oversized):
        return ""
    try:
        return _custom_id_in(json.loads(raw))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return ""


def _custom_id_in(data: object) -> str:
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    return custom_id if isinstance(custom_id, str) else ""


def _record_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def output_record(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """An answered line of the output file."""
    return {
        "id": _record_id(),
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": body.get("id", ""),
            "body": body,
        },
        "error": None,
    }


def failure_record(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line the API refused or failed (the status and error body a live
    request would have got), for the error file."""
    return {
        "id": _record_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": "", "body": body},
        "error": None,
    }


def error_record(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line that never became a request (malformed, expired, cancelled), for
    the error file."""
    return {
        "id": _record_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
