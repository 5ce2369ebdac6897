"""Stable error codes and the one exception an engine answers with (as an
engines.wire.replies.ErrorReply). Each code is mapped to one HTTP status and
one WebSocket error frame by the front (platform/api/errors.py)."""

import enum


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
    # A node's relay could not reach the engine named (platform/node_link/relay.py): the
    # request never started there, and the caller tries another replica.
    UNREACHABLE = "unreachable"


class ProtocolError(Exception):
    """A request that cannot be served, carried back as an error frame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


class FrameTooLarge(ProtocolError):
    """The header announced more bytes than the cap: the connection is closed."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            ErrorCode.BAD_REQUEST, f"frame of {size} bytes exceeds the {limit} cap"
        )


def bad_request(message: str) -> ProtocolError:
    """A bad_request error with its message (what every check raises)."""
    return ProtocolError(ErrorCode.BAD_REQUEST, message)
