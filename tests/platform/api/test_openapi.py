"""The OpenAPI document lists every status an endpoint can answer, from the
error tables, so a status added there cannot be left out of it."""

import pytest

from api import bodies, errors, openapi
from api.schemas import ENDPOINT_SCHEMAS, EmbeddingRequest, parse
from batches import quotas
from engines.wire.errors import ErrorCode

KEYED_POSTS = [(path, "post") for path in ENDPOINT_SCHEMAS]


def openapi_responses(path: str, method: str) -> dict:
    return openapi.openapi_document()["paths"][path][method]["responses"]


def documented(path: str, method: str) -> set[int]:
    return {int(status) for status in openapi_responses(path, method)}


def refusals_before_the_view() -> list[errors.ApiError]:
    """What any API path can answer before its view runs (roundhouse.asgi)."""
    return [
        errors.too_large(17, 16),
        errors.too_large(None, 16),
        errors.invalid_request("Content-Length is not a number."),
    ]


def key_refusals() -> list[errors.ApiError]:
    return [
        errors.unauthorized("unknown"),
        errors.rate_limited("too many invalid keys", 30, code="too_many_invalid_keys"),
        errors.database_unavailable("the key cannot be checked now"),
    ]


def pipeline_errors() -> list[errors.ApiError]:
    """Every error a model endpoint's view can answer: the front's refusals
    and every engine failure, through the functions the views call."""
    with pytest.raises(errors.ApiError) as bad_body:
        parse(EmbeddingRequest, b"{not json")
    return [
        *refusals_before_the_view(),
        errors.method_not_allowed("POST", "/v1/embeddings"),
        *key_refusals(),
        bad_body.value,
        errors.model_not_found("m"),
        errors.invalid_request("wrong task", param="model"),
        errors.rate_limited("over rpm", 30),
        *(errors.engine_error(code, "why") for code in ErrorCode),
        errors.engine_error("a-code-no-table-knows", "why"),
        errors.from_mapping(errors.NO_ENGINE, "why", code="no_engine"),
        errors.from_mapping(errors.ENGINE_DIED, "why", code="engine_died"),
        errors.from_mapping(errors.ENGINE_TIMEOUT, "why", code="engine_timeout"),
        errors.engine_error("internal", "Internal error."),
    ]


def missing(path: str, method: str, answers: list[errors.ApiError]) -> set[int]:
    return {answer.status for answer in answers} - documented(path, method)


@pytest.mark.parametrize(("path", "method"), KEYED_POSTS)
def test_model_endpoints_document_every_status_they_can_answer(path, method):
    """Every status the error tables and the front's refusals give is a
    response of each model endpoint, besides 200."""
    assert missing(path, method, pipeline_errors()) == set()
    assert {200, 400, 401, 404, 405, 413, 429, 502, 503, 504} <= documented(
        path, method
    )


def test_other_endpoints_document_their_statuses():
    """/v1/models can refuse the key, or fail to check it (503 while the
    database is down); the document itself, only the request."""
    models = [
        *refusals_before_the_view(),
        errors.method_not_allowed("GET", "/v1/models"),
        *key_refusals(),
    ]
    assert missing("/v1/models", "get", models) == set()
    assert documented("/v1/models", "get") == {200, 400, 401, 405, 413, 429, 503}
    retry = openapi_responses("/v1/models", "get")["503"]["headers"]["Retry-After"]
    assert retry["required"] is True
    document = [*refusals_before_the_view(), errors.method_not_allowed("GET", "x")]
    assert missing("/v1/openapi.json", "get", document) == set()
    assert 401 not in documented("/v1/openapi.json", "get")


def test_the_batch_apis_document_their_refusals(settings):
    """The Files and Batch APIs' refusals, from the functions that give them:
    an upload over an owner's whole quota (413), over what is left of it or
    the server's storage (429), a bad purpose (400); an unknown file or batch
    (404); a batch over its owner's quota (429). The control: the files
    listing, which looks nothing up, documents no 404."""
    settings.ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES = 10
    roomy = 10**9
    uploads = [
        *refusals_before_the_view(),
        errors.method_not_allowed("POST, GET", "/v1/files"),
        *key_refusals(),
        quotas.Room(owner=roomy, server=roomy).refusal(11),
        quotas.Room(owner=0, server=roomy).refusal(1),
        quotas.Room(owner=roomy, server=0).refusal(1),
        errors.invalid_request("not that purpose", param="purpose"),
    ]
    assert [error.status for error in uploads[-4:]] == [413, 429, 429, 400]
    assert missing("/v1/files", "post", uploads) == set()
    lookups = [*key_refusals(), errors.from_mapping(errors.NOT_FOUND, "x", code="y")]
    for path, method in [
        ("/v1/files/{file_id}", "get"),
        ("/v1/files/{file_id}", "delete"),
        ("/v1/files/{file_id}/content", "get"),
        ("/v1/batches", "post"),
        ("/v1/batches/{batch_id}", "get"),
        ("/v1/batches/{batch_id}/cancel", "post"),
    ]:
        assert missing(path, method, lookups) == set(), path
    over = quotas.Room(owner=0, server=roomy).refusal(1)
    assert missing("/v1/batches", "post", [over]) == set()
    assert 404 not in documented("/v1/files", "get")  # the control: no lookup


def test_a_status_added_to_a_table_is_documented(monkeypatch):
    """The control: a new engine code with a new status shows up in the
    document with no change to api.openapi, and the check above would have
    caught its absence."""
    new = errors.Mapping(507, "server_error")
    answers = [errors.from_mapping(new, "full", code="disk_full")]
    path = "/v1/chat/completions"
    assert missing(path, "post", answers) == {507}
    monkeypatch.setitem(
        errors.STEP_ERRORS, "engine", (*errors.STEP_ERRORS["engine"], new)
    )
    openapi.openapi_document.cache_clear()
    try:
        assert missing(path, "post", answers) == set()
        assert "507" not in openapi_responses("/v1/models", "get")
    finally:
        monkeypatch.undo()
        openapi.openapi_document.cache_clear()
    assert missing(path, "post", answers) == {507}


def test_errors_use_the_error_object_and_say_when_to_retry():
    """Every error response is OpenAI's error object (a dialect's path: its
    own; Ollama's paths: its `{"error"}`, but for the size cap's 413, answered
    before routing); 429 and 503 document Retry-After (they always send it),
    405 its Allow header."""
    for path, methods in openapi.openapi_document()["paths"].items():
        error_body = openapi.ERROR_BODIES.get(path, bodies.ErrorResponse).__name__
        for operation in methods.values():
            for status, response in operation["responses"].items():
                if status.startswith("2"):
                    continue
                schema = response["content"]["application/json"]["schema"]
                ollama = path.startswith("/api/") and status != "413"
                name = "OllamaErrorResponse" if ollama else error_body
                assert schema == {"$ref": f"#/components/schemas/{name}"}
                headers = response.get("headers", {})
                if status in ("429", "503"):
                    assert headers["Retry-After"]["required"] is True
                if status == "405":
                    assert headers["Allow"]["required"] is True
    for answer in pipeline_errors():
        if answer.status in (429, 503):
            assert "Retry-After" in answer.response()
    error = openapi.openapi_document()["components"]["schemas"]["Error"]
    assert set(error["required"]) == {
        "message",
        "type",
        "param",
        "code",
    }


def test_streams_are_documented_as_server_sent_events():
    """Model endpoints that stream document text/event-stream beside JSON."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        content = openapi_responses(path, "post")["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
    content = openapi_responses("/v1/embeddings", "post")["200"]["content"]
    assert set(content) == {"application/json"}
