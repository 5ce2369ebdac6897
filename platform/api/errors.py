"""Errors of the OpenAI-compatible API: one table from engine error codes to HTTP
statuses, and OpenAI's error-object shape for every failure the front answers."""

import json
from dataclasses import dataclass

from django.http import HttpResponse

from engines.protocol import ErrorCode


@dataclass
class ApiError(Exception):
    """A failure answered as `{"error": {message, type, param, code}}`."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> HttpResponse:
        response = HttpResponse(
            json.dumps(self.body()), status=self.status, content_type="application/json"
        )
        if self.retry_after_s is not None:
            response["Retry-After"] = str(self.retry_after_s)
        return response


@dataclass(frozen=True)
class Mapping:
    status: int
    type: str
    retry_after_s: int | None = None


# The one table: engine error code -> HTTP status and OpenAI error type. The
# WebSocket chat maps through the same table.
ENGINE_ERRORS: dict[str, Mapping] = {
    ErrorCode.BAD_REQUEST: Mapping(400, "invalid_request_error"),
    ErrorCode.UNKNOWN_MODEL: Mapping(404, "invalid_request_error"),
    ErrorCode.OVERLOADED: Mapping(429, "rate_limit_error", retry_after_s=1),
    ErrorCode.INSUFFICIENT_MEMORY: Mapping(503, "server_error", retry_after_s=5),
    ErrorCode.COOLING: Mapping(503, "server_error", retry_after_s=5),
    ErrorCode.CANCELLED: Mapping(503, "server_error", retry_after_s=1),
    # The engine refused the front's own token: a fault of ours, not the caller's.
    ErrorCode.UNAUTHORIZED: Mapping(502, "server_error"),
    ErrorCode.INTERNAL: Mapping(500, "server_error"),
}

# Failures of the engine connection itself (engines.client error classes).
ENGINE_DIED = Mapping(502, "server_error")
ENGINE_TIMEOUT = Mapping(504, "server_error")
NO_ENGINE = Mapping(503, "server_error", retry_after_s=5)


def engine_error(code: str, message: str) -> ApiError:
    """The API error for an engine's error frame."""
    mapping = ENGINE_ERRORS.get(code, ENGINE_ERRORS[ErrorCode.INTERNAL])
    return from_mapping(mapping, message, code=code)


def from_mapping(mapping: Mapping, message: str, *, code: str) -> ApiError:
    """The API error a table row gives, with this message and code."""
    return ApiError(
        mapping.status,
        message,
        type=mapping.type,
        code=code,
        retry_after_s=mapping.retry_after_s,
    )


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key")


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{name}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def too_large(size: int | None, cap: int) -> ApiError:
    """413 for a body of `size` bytes, or (None) one that went over while read."""
    if size is None:
        message = f"The request body exceeds the limit of {cap} bytes."
    else:
        message = f"The request body has {size} bytes; the limit is {cap} bytes."
    return ApiError(413, message, code="request_too_large")


def rate_limited(message: str, retry_after_s: int) -> ApiError:
    return ApiError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        retry_after_s=max(1, int(retry_after_s)),
    )
