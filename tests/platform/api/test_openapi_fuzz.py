"""Schemathesis against the live front (uvicorn, `manage.py supervise`, a real
engine serving SmolLM2 and MiniLM): requests generated from /v1/openapi.json,
valid ones and invalid ones, with a real key and the real model names. No
answer may be a server error, and every answer must be what the document says:
a documented status, with a documented content type and headers, and a body
(JSON, or each Server-Sent Event of a stream) that fits its schema.

Bounded: a fixed number of examples per operation, derandomized (the same
requests on every run), no shrinking, and short answers (max_tokens capped)."""

import itertools

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.platform import live_platform
from tests.platform.live_platform import CHAT, EMBEDDER

# The live platform of the OpenAI tests, started again for this module.
database = live_platform.database
live = live_platform.live
models_dir_path = live_platform.models_dir_path

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Generated model names are replaced by these in turn: mostly a model the
# endpoint serves, sometimes one of another task, or one that does not exist. (The
# configured model that no engine serves answers 503, a server error by design:
# tests/platform/api/test_openai.py covers it.)
MODELS = {
    "/v1/chat/completions": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/v1/completions": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/v1/embeddings": (EMBEDDER, EMBEDDER, EMBEDDER, CHAT, "no-such-model"),
    "/tokenize": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/detokenize": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/v1/rerank": (EMBEDDER, EMBEDDER, EMBEDDER, CHAT, "no-such-model"),
    "/v2/rerank": (EMBEDDER, EMBEDDER, EMBEDDER, CHAT, "no-such-model"),
    "/v1/responses": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/api/chat": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/api/generate": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/api/embed": (EMBEDDER, EMBEDDER, EMBEDDER, CHAT, "no-such-model"),
    "/v1/messages": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
    "/v1/messages/count_tokens": (CHAT, CHAT, CHAT, EMBEDDER, "no-such-model"),
}
# The longest answer a generated request may ask for.
MAX_TOKENS = 4
# The fields that bound an answer's length, by endpoint (the first is set
# where none is).
LIMIT_FIELDS = {
    "/v1/responses": ("max_output_tokens",),
    "/v1/messages": ("max_tokens",),
    "*": ("max_tokens", "max_completion_tokens"),
}
POSITIVE_EXAMPLES = 25
NEGATIVE_EXAMPLES = 15
BOUNDED = settings(
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
MODEL_ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
]
# The same endpoints at a second path (not fuzzed again).
ALIASES = ["/v1/tokenize", "/v1/detokenize"]
GENERATION_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)
# Ollama's (api.dialects.ollama): answers asked whole, not streamed (NDJSON is not
# checked against the schema), and short (options.num_predict capped).
OLLAMA_ENDPOINTS = ["/api/chat", "/api/generate", "/api/embed"]
OLLAMA_OPERATIONS = {
    ("/api/chat", "POST"),
    ("/api/generate", "POST"),
    ("/api/embed", "POST"),
    ("/api/embeddings", "POST"),
    ("/api/tags", "GET"),
    ("/api/show", "POST"),
    ("/api/ps", "GET"),
    ("/api/version", "GET"),
    ("/api/pull", "POST"),
}


def bounded(case, model: str) -> None:
    """A real model name and a short answer, whatever was generated."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    if case.operation.path.startswith("/api/"):
        if case.operation.path == "/api/embed":
            return
        body["stream"] = False
        options = body.get("options")
        if options is None:
            options = body["options"] = {}
        if isinstance(options, dict):
            limit = options.get("num_predict")
            if type(limit) is not int or limit > MAX_TOKENS or limit < 1:
                options["num_predict"] = MAX_TOKENS
        return
    if case.operation.path not in GENERATION_ENDPOINTS:
        return
    names = LIMIT_FIELDS.get(case.operation.path, LIMIT_FIELDS["*"])
    if all(body.get(name) is None for name in names):
        body[names[0]] = MAX_TOKENS
    for name in names:
        limit = body.get(name)
        # Only valid limits are capped: an invalid one must still be refused.
        if type(limit) in (int, float) and limit > MAX_TOKENS:
            body[name] = MAX_TOKENS


@pytest.fixture(scope="module")
def schema(live):
    return schemathesis.openapi.from_url(f"{live.base_url}/v1/openapi.json")


def fuzz(live, operation, mode, examples: int) -> list[int]:
    """Send `examples` generated requests and check every answer; the
    statuses seen."""
    statuses: list[int] = []
    models = itertools.cycle(MODELS.get(operation.path, [""]))

    @settings(BOUNDED, max_examples=examples)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        bounded(case, next(models))
        case.headers = {
            **(case.headers or {}),
            "Authorization": f"Bearer {live.keys['main']}",
        }
        response = case.call_and_validate(
            base_url=live.base_url, checks=CHECKS, timeout=120
        )
        statuses.append(response.status_code)

    run()
    return statuses


def test_the_document_loads_and_lists_every_endpoint(schema):
    """The document the front serves is a valid OpenAPI document (schemathesis
    leaves out the document's own path)."""
    operations = {
        (result.ok().path, result.ok().method.upper())
        for result in schema.get_all_operations()
    }
    assert operations == {
        *((path, "POST") for path in MODEL_ENDPOINTS + ALIASES),
        ("/v1/models", "GET"),
        ("/v1/models/{name}", "DELETE"),
        ("/v1/pulls", "POST"),
        ("/v1/pulls", "GET"),
        ("/v1/pulls/{pull_id}", "GET"),
        ("/v1/pulls/{pull_id}", "DELETE"),
        ("/v1/pulls/{pull_id}/events", "GET"),
        ("/v1/responses/{response_id}", "GET"),
        ("/v1/responses/{response_id}", "DELETE"),
        ("/v1/responses/{response_id}/input_items", "GET"),
        *OLLAMA_OPERATIONS,
        ("/v1/files", "POST"),
        ("/v1/files", "GET"),
        ("/v1/files/{file_id}", "GET"),
        ("/v1/files/{file_id}", "DELETE"),
        ("/v1/files/{file_id}/content", "GET"),
        ("/v1/batches", "POST"),
        ("/v1/batches", "GET"),
        ("/v1/batches/{batch_id}", "GET"),
        ("/v1/batches/{batch_id}/cancel", "POST"),
    }


@pytest.mark.parametrize("path", MODEL_ENDPOINTS + OLLAMA_ENDPOINTS)
def test_valid_requests_get_documented_answers(live, schema, path):
    """Requests that fit the schema: answered as documented, never 5xx."""
    statuses = fuzz(
        live,
        schema[path]["POST"],
        schemathesis.GenerationMode.POSITIVE,
        POSITIVE_EXAMPLES,
    )
    assert 200 in statuses  # the fuzzer reached the engine


@pytest.mark.parametrize("path", MODEL_ENDPOINTS + OLLAMA_ENDPOINTS)
def test_invalid_requests_get_documented_answers(live, schema, path):
    """Requests that break the schema: refused as documented."""
    statuses = fuzz(
        live,
        schema[path]["POST"],
        schemathesis.GenerationMode.NEGATIVE,
        NEGATIVE_EXAMPLES,
    )
    assert 400 in statuses


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models",
        "/v1/openapi.json",
        "/v1/files",
        "/v1/batches",
        "/api/tags",
        "/api/ps",
        "/api/version",
    ],
)
def test_listings_get_documented_answers(live, schema, path):
    statuses = fuzz(live, schema[path]["GET"], schemathesis.GenerationMode.POSITIVE, 1)
    assert statuses == [200]


def test_a_check_fails_on_an_undocumented_answer(live, schema):
    """The control: the same checks against a document that leaves out the
    model endpoints' 404 fail on the 404 the front answers for an unknown
    model."""
    raw = schema.raw_schema
    operation = raw["paths"]["/v1/embeddings"]["post"]
    trimmed = {
        **raw,
        "paths": {
            "/v1/embeddings": {
                "post": {
                    **operation,
                    "responses": {
                        status: response
                        for status, response in operation["responses"].items()
                        if status != "404"
                    },
                }
            }
        },
    }
    strict = schemathesis.openapi.from_dict(trimmed)
    case = strict["/v1/embeddings"]["POST"].Case(
        body={"model": "no-such-model", "input": "x"},
        headers={"Authorization": f"Bearer {live.keys['main']}"},
    )
    with pytest.raises(schemathesis.errors.FailureGroup, match="Undocumented status"):
        case.call_and_validate(base_url=live.base_url, checks=CHECKS, timeout=60)
