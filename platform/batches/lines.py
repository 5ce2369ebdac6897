"""One line of a batch's input file: its typed shape (unknown keys refused),
and the records the output and error files hold, in OpenAI's shapes."""

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "MalformedLine",
    "custom_id_of",
    "RequestLine",
    "error_record",
    "failure_record",
    "output_record",
    "read_line",
]


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


def read_line(raw: bytes, *, endpoint: str, max_bytes: int) -> RequestLine:
    """The request on one line of the input file (MalformedLine otherwise:
    over the size cap, not JSON, not the line shape, or for another endpoint
    than the batch's)."""
    if len(raw) > max_bytes:
        raise MalformedLine(
            "", f"The line has {len(raw)} bytes; the cap is {max_bytes}."
        )
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


def custom_id_of(raw: bytes) -> str:
    """A line's custom_id where it has one ("" otherwise), whatever else is
    wrong with it."""
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
