"""Errors of the OpenAI-compatible API: one table from engine error codes to HTTP
statuses, the codes of the front's own refusals, and OpenAI's error-object shape
for every failure the front answers."""

import enum
import json
from dataclasses import dataclass

from django.http import HttpResponse

from engines.wire.errors import ErrorCode


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

    def websocket_message(self, stream_id: str | None) -> dict:
        """The WebSocket chat's `error` message for this failure: the REST
        answer's code (a status's own when it has none), its status, and
        `retry_after` where REST sends Retry-After."""
        message = {
            "type": "error",
            "id": stream_id,
            "code": self.code or WEBSOCKET_CODES.get(self.status, ErrorCode.INTERNAL),
            "status": self.status,
            "message": self.message,
        }
        if self.retry_after_s is not None:
            message["retry_after"] = self.retry_after_s
        return message

    def response(self) -> HttpResponse:
        response = HttpResponse(
            json.dumps(self.body()), status=self.status, content_type="application/json"
        )
        if self.retry_after_s is not None:
            response["Retry-After"] = str(self.retry_after_s)
        return response


class ApiCode(enum.StrEnum):
    """The codes of the front's own refusals and failures (an engine's are
    ErrorCode's): each is an error's `code`, and a usage row's."""

    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_TASK_MISMATCH = "model_task_mismatch"
    NOT_FOUND = "not_found"
    UNKNOWN_URL = "unknown_url"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TOO_LARGE = "request_too_large"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    CONCURRENCY_LIMIT_EXCEEDED = "concurrency_limit_exceeded"
    TOO_MANY_INVALID_KEYS = "too_many_invalid_keys"
    DATABASE_UNAVAILABLE = "database_unavailable"
    CLUSTER_UNCONFIRMED = "cluster_unconfirmed"
    # The engine connection failed (engines.wire.client's error classes), or
    # no engine could take the request.
    ENGINE_DIED = "engine_died"
    ENGINE_TIMEOUT = "engine_timeout"
    ENGINE_UNREACHABLE = "engine_unreachable"
    NO_ENGINE = "no_engine"
    # The caller went away before the answer ended.
    CLIENT_CLOSED = "client_closed"
    # The WebSocket chat's.
    CONVERSATION_NOT_FOUND = "conversation_not_found"
    TOO_MANY_STREAMS = "too_many_streams"
    # The Batch API's: refusals of its files and batches, and why a batch (or
    # a line of it, in the error file) ended without an answer.
    FILE_NOT_FOUND = "file_not_found"
    BATCH_NOT_FOUND = "batch_not_found"
    QUOTA_EXCEEDED = "quota_exceeded"
    STORAGE_FULL = "storage_full"
    INVALID_REQUEST = "invalid_request"
    FILE_UNREADABLE = "file_unreadable"
    BATCH_EXPIRED = "batch_expired"
    BATCH_CANCELLED = "batch_cancelled"
    BATCH_CRASHED = "batch_crashed"
    BATCH_RUN_FAILED = "batch_run_failed"
    KEY_REVOKED = "key_revoked"
    KEY_DELETED = "key_deleted"
    # Managing models (/v1/pulls, DELETE /v1/models/{name}): a key without
    # the right, a pull that does not exist, a source the Hub refused (by
    # the Hub's status), a model still placed or loaded.
    MODELS_NOT_MANAGED = "models_not_managed"
    PULL_NOT_FOUND = "pull_not_found"
    SOURCE_INVALID = "source_invalid"
    SOURCE_GATED = "source_gated"
    SOURCE_NOT_FOUND = "source_not_found"
    MODEL_NAME_TAKEN = "model_name_taken"
    HUB_FAILED = "hub_failed"
    MODEL_IN_USE = "model_in_use"
    # The Responses API's: a stored response that does not exist (or is
    # another key's), as read or as a request's previous_response_id.
    RESPONSE_NOT_FOUND = "response_not_found"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"


@dataclass(frozen=True)
class Mapping:
    status: int
    type: str
    retry_after_s: int | None = None


# The one table: engine error code -> HTTP status and OpenAI error type. The
# WebSocket chat maps through the same table.
ENGINE_ERRORS: dict[str, Mapping] = {
    ErrorCode.BAD_REQUEST: Mapping(400, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: Mapping(400, "invalid_request_error"),
    ErrorCode.UNKNOWN_MODEL: Mapping(404, "invalid_request_error"),
    ErrorCode.OVERLOADED: Mapping(429, "rate_limit_error", retry_after_s=1),
    ErrorCode.INSUFFICIENT_MEMORY: Mapping(503, "server_error", retry_after_s=5),
    ErrorCode.COOLING: Mapping(503, "server_error", retry_after_s=5),
    ErrorCode.CANCELLED: Mapping(503, "server_error", retry_after_s=1),
    # The engine refused the front's own token: a fault of ours, not the caller's.
    ErrorCode.UNAUTHORIZED: Mapping(502, "server_error"),
    ErrorCode.INTERNAL: Mapping(500, "server_error"),
    # A node's relay could not reach the engine (platform/node_link/relay.py); the front
    # tries another replica first, and answers this when none is left.
    ErrorCode.UNREACHABLE: Mapping(503, "server_error", retry_after_s=5),
}

# Failures of the engine connection itself (engines.wire.client error classes).
ENGINE_DIED = Mapping(502, "server_error")
ENGINE_TIMEOUT = Mapping(504, "server_error")
NO_ENGINE = Mapping(503, "server_error", retry_after_s=5)

# The front's own refusals.
INVALID_REQUEST = Mapping(400, "invalid_request_error")
UNAUTHORIZED = Mapping(401, "invalid_request_error")
NOT_FOUND = Mapping(404, "invalid_request_error")
METHOD_NOT_ALLOWED = Mapping(405, "invalid_request_error")
TOO_LARGE = Mapping(413, "invalid_request_error")
FORBIDDEN = Mapping(403, "permission_error")
CONFLICT = Mapping(409, "invalid_request_error")
# The Hub failed (a pull's plan could not be read): not the caller's fault.
HUB_FAILED = Mapping(502, "server_error")
RATE_LIMITED = Mapping(429, "rate_limit_error", retry_after_s=1)
# The database is unavailable: a key this process does not remember cannot be
# checked, a fleet this process never read cannot be read.
DATABASE_UNAVAILABLE = Mapping(503, "server_error", retry_after_s=5)

# The WebSocket `error` message's code for a refusal REST answers without one
# (a body the schema refused is a 400 with no code: "bad_request").
WEBSOCKET_CODES: dict[int, str] = {
    400: ErrorCode.BAD_REQUEST,
    401: ApiCode.INVALID_API_KEY,
    404: ApiCode.NOT_FOUND,
    413: ApiCode.REQUEST_TOO_LARGE,
    429: ApiCode.RATE_LIMIT_EXCEEDED,
}

# What each step of a request can answer instead of its result. The OpenAPI
# document (api.openapi) lists for each endpoint the statuses of the steps it
# runs, so a row added to a table above is documented with it.
STEP_ERRORS: dict[str, tuple[Mapping, ...]] = {
    # Every API path, before its view: a Content-Length that is not a number,
    # a body over the size cap (roundhouse.asgi).
    "read": (INVALID_REQUEST, TOO_LARGE),
    "method": (METHOD_NOT_ALLOWED,),
    # An unknown or revoked key; a client over its failed keys; a key that
    # cannot be checked while the database is down.
    "key": (UNAUTHORIZED, RATE_LIMITED, DATABASE_UNAVAILABLE),
    "body": (INVALID_REQUEST,),
    # An unknown or forbidden model; one of the wrong task for the endpoint;
    # the fleet unreadable while the database is down.
    "model": (NOT_FOUND, INVALID_REQUEST, DATABASE_UNAVAILABLE),
    "limits": (RATE_LIMITED,),
    "engine": (*ENGINE_ERRORS.values(), ENGINE_DIED, ENGINE_TIMEOUT, NO_ENGINE),
    # Managing models: a key without the right to.
    "manage": (FORBIDDEN,),
    # A pull's source read before a byte (catalog.hub.HubError): a bad
    # source, a gated repository, an unknown one, a name taken, the Hub failing.
    "pull": (INVALID_REQUEST, UNAUTHORIZED, NOT_FOUND, CONFLICT, HUB_FAILED),
    # A pull's id, or a model's name, that does not exist.
    "lookup": (NOT_FOUND,),
    # A model still placed or loaded somewhere.
    "in_use": (CONFLICT,),
}


def engine_error(code: ErrorCode, message: str) -> ApiError:
    """The API error for an engine's error frame."""
    mapping = ENGINE_ERRORS.get(code, ENGINE_ERRORS[ErrorCode.INTERNAL])
    return from_mapping(mapping, message, code=code)


def from_mapping(
    mapping: Mapping, message: str, *, code: str, param: str | None = None
) -> ApiError:
    """The API error a table row gives, with this message and code."""
    return ApiError(
        mapping.status,
        message,
        type=mapping.type,
        param=param,
        code=code,
        retry_after_s=mapping.retry_after_s,
    )


def unauthorized(message: str) -> ApiError:
    return from_mapping(UNAUTHORIZED, message, code=ApiCode.INVALID_API_KEY)


def model_not_found(name: str) -> ApiError:
    return from_mapping(
        NOT_FOUND,
        f"The model '{name}' does not exist or you do not have access to it.",
        param="model",
        code=ApiCode.MODEL_NOT_FOUND,
    )


def database_unavailable(message: str) -> ApiError:
    """503 with Retry-After: the request needs the database, which is down."""
    return from_mapping(
        DATABASE_UNAVAILABLE, message, code=ApiCode.DATABASE_UNAVAILABLE
    )


def cluster_unconfirmed(message: str) -> ApiError:
    """503: a node cut off from the cluster's database does not serve what it
    can no longer confirm is its to serve."""
    return from_mapping(DATABASE_UNAVAILABLE, message, code=ApiCode.CLUSTER_UNCONFIRMED)


def method_not_allowed(method: str, path: str) -> ApiError:
    return from_mapping(
        METHOD_NOT_ALLOWED, f"Use {method} for {path}.", code=ApiCode.METHOD_NOT_ALLOWED
    )


def too_large(size: int | None, cap: int) -> ApiError:
    """413 for a body of `size` bytes, or (None) one that went over while read."""
    if size is None:
        message = f"The request body exceeds the limit of {cap} bytes."
    else:
        message = f"The request body has {size} bytes; the limit is {cap} bytes."
    return from_mapping(TOO_LARGE, message, code=ApiCode.REQUEST_TOO_LARGE)


def invalid_request(
    message: str, *, param: str | None = None, code: str | None = None
) -> ApiError:
    """400: the request cannot be served as sent."""
    return ApiError(INVALID_REQUEST.status, message, param=param, code=code)


def rate_limited(
    message: str, retry_after_s: int, *, code: str = ApiCode.RATE_LIMIT_EXCEEDED
) -> ApiError:
    """429 with Retry-After: the key, or the client, is over a limit."""
    return ApiError(
        RATE_LIMITED.status,
        message,
        type=RATE_LIMITED.type,
        code=code,
        retry_after_s=max(1, int(retry_after_s)),
    )


def models_not_managed() -> ApiError:
    """403: the key may not pull or delete models."""
    return from_mapping(
        FORBIDDEN,
        "This API key may not manage models: an administrator can allow it "
        "(the key's 'manages models' in the admin).",
        code=ApiCode.MODELS_NOT_MANAGED,
    )


# A pull's refusal by the Hub's status (catalog.hub.HubError): the mapping and
# the code; a status not listed is the Hub failing.
HUB_REFUSALS: dict[int, tuple[Mapping, str]] = {
    400: (INVALID_REQUEST, ApiCode.SOURCE_INVALID),
    401: (UNAUTHORIZED, ApiCode.SOURCE_GATED),
    404: (NOT_FOUND, ApiCode.SOURCE_NOT_FOUND),
    409: (CONFLICT, ApiCode.MODEL_NAME_TAKEN),
}


def hub_refused(status: int, message: str) -> ApiError:
    """The API error for a pull the Hub refused before a byte: its status
    (400 a bad source, 401 gated, 404 unknown, 409 a name taken) with its
    message; any other status is the Hub failing (502)."""
    mapping, code = HUB_REFUSALS.get(status, (HUB_FAILED, ApiCode.HUB_FAILED))
    param = "name" if status == 409 else "source"
    return from_mapping(mapping, message, code=code, param=param)


def pull_not_found(pull_id: str) -> ApiError:
    return from_mapping(
        NOT_FOUND, f"No such pull: {pull_id!r}.", code=ApiCode.PULL_NOT_FOUND
    )


def model_in_use(reason: str) -> ApiError:
    """409: the model cannot be deleted while it is loaded or placed; the
    reason says where."""
    return from_mapping(
        CONFLICT,
        f"Not deleted: {reason}. Disable the model (or lower its replicas) and "
        "delete it once no engine holds it.",
        code=ApiCode.MODEL_IN_USE,
    )
