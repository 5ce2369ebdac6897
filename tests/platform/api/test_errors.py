"""The one table from engine error codes to HTTP statuses, and request parsing."""

import json

import pytest

from api import errors
from api.schemas import ChatCompletionRequest, EmbeddingRequest, body_fields, parse
from engines.wire.errors import ErrorCode


def test_every_engine_code_has_a_status():
    assert set(errors.ENGINE_ERRORS) == set(ErrorCode)


@pytest.mark.parametrize(
    ("code", "status", "retry"),
    [
        ("bad_request", 400, False),
        ("unknown_model", 404, False),
        ("overloaded", 429, True),
        ("insufficient_memory", 503, True),
        ("cooling", 503, True),
        ("internal", 500, False),
        ("something-new", 500, False),  # an unknown code is an internal error
    ],
)
def test_engine_errors_map_to_statuses(code, status, retry):
    response = errors.engine_error(code, "why").response()
    assert response.status_code == status
    assert ("Retry-After" in response) is retry
    body = json.loads(response.content)
    assert body == {
        "error": {
            "message": "why",
            "type": body["error"]["type"],
            "param": None,
            "code": code,
        }
    }


def test_parse_names_the_bad_field():
    with pytest.raises(errors.ApiError) as error:
        parse(
            ChatCompletionRequest,
            b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}',
        )
    assert error.value.status == 400
    assert error.value.param == "messages.0.role"
    assert "messages.0.role" in error.value.message


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"input": "x"}', "Missing required parameter: 'model'"),
        (b'{"model": "m", "input": []}', "'input'"),
        (b'{"model": "m", "input": "x", "encoding_format": "hex"}', "encoding_format"),
    ],
)
def test_parse_errors_are_400s(raw, needle):
    with pytest.raises(errors.ApiError) as error:
        parse(EmbeddingRequest, raw)
    assert error.value.status == 400
    assert needle in error.value.message


def test_the_fronts_codes_are_not_engine_codes():
    """A code names one failure: none of the front's own codes (ApiCode) is
    also an engine's (ErrorCode); the WebSocket chat's codes for statuses
    are the front's (or bad_request)."""
    assert not set(errors.ApiCode) & set(ErrorCode)
    assert set(errors.WEBSOCKET_CODES.values()) <= set(errors.ApiCode) | {
        ErrorCode.BAD_REQUEST
    }


def test_stop_strings_and_max_tokens_reach_the_engine_fields():
    request = parse(
        ChatCompletionRequest,
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "developer", "content": "be brief"}],
                "stop": "END",
                "max_completion_tokens": 9,
                "temperature": 0,
            }
        ).encode(),
    )
    [engine_request] = request.engine_requests()
    assert body_fields(engine_request) == {
        "temperature": 0.0,
        "stop": ["END"],
        "messages": [{"role": "system", "content": "be brief"}],
        "max_tokens": 9,
    }


def test_any_failure_becomes_the_apis_error_in_one_place(caplog):
    """api.pipeline.api_error, which every transport's failures go through
    (REST, the WebSocket chat, batch lines, the Batch API's views): a refusal
    as it is, the database failing as 503 database_unavailable, an engine's
    failure as its error, anything else as a logged 500 that says no more
    than "Internal error." (control: the unexpected one is the only one
    logged)."""
    from django import db

    from api.pipeline import api_error
    from engines.wire.client import EngineDied, EngineRequestError

    refusal = errors.model_not_found("nope")
    assert api_error(refusal, what="t") is refusal
    outage = api_error(db.OperationalError("gone"), what="t")
    assert (outage.status, outage.code) == (503, "database_unavailable")
    died = api_error(EngineDied("dropped"), what="t")
    assert (died.status, died.code) == (502, "engine_died")
    busy = api_error(EngineRequestError(ErrorCode.OVERLOADED, "full"), what="t")
    assert (busy.status, busy.code) == (429, "overloaded")
    assert "went wrong" not in caplog.text
    internal = api_error(RuntimeError("went wrong"), what="the test's call")
    assert (internal.status, internal.message) == (500, "Internal error.")
    assert "the test's call failed" in caplog.text and "went wrong" in caplog.text
