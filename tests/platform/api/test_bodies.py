"""Response bodies are api.bodies' models, and /v1/openapi.json documents them
from those models alone: the document's response schemas are the models', and
real answers (the front's ASGI handler, a real engine serving SmolLM2 and
MiniLM) are the models' key for key and fit the document's schemas. The
controls prove that the check fails on a body that breaks the shape."""

import json

import jsonschema_rs
import pytest
from asgiref.sync import sync_to_async
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone
from pydantic import BaseModel, ValidationError

from api import bodies, errors, openapi
from api.dialects.ollama.openapi import ollama_paths
from batches.models import Batch
from engines.wire.client import write_connection_file
from routing.select import EngineStatus, ModelRoute, Snapshot
from tests.engines.conftest import EMBEDDER, embedder_spec, start_engine
from tests.engines.generating import gguf_spec
from tests.factories import ApiKeyFactory
from tests.platform.api.chat_front import CHAT, WEATHER_TOOL, asgi_request

ENGINE = "bodies0"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def document_schemas() -> dict:
    return openapi.openapi_document()["components"]["schemas"]


def validator(model: type[BaseModel]) -> jsonschema_rs.Draft202012Validator:
    """The document's schema of a body, its references resolved in the
    document's components."""
    return jsonschema_rs.Draft202012Validator(
        {
            "$ref": f"#/components/schemas/{model.__name__}",
            "components": {"schemas": document_schemas()},
        }
    )


def is_the_models(model: type[BaseModel], body: dict) -> bool:
    """The body is the model's, key for key: none missing, none added, the
    nulls it sends sent."""
    try:
        return model.model_validate(body).model_dump(mode="json") == body
    except ValidationError:
        return False


def fits(model: type[BaseModel], body: dict) -> None:
    """The body is the model's, key for key (none missing, none added, the
    nulls it sends sent), and fits the document's schema."""
    assert model.model_validate(body).model_dump(mode="json") == body
    validator(model).validate(body)


# -- the document ------------------------------------------------------------------


def test_the_response_schemas_are_the_models():
    """Every response body's schema in the document, and each of its parts',
    is the one generated from its model; every other schema is a request's:
    no response schema is written by hand."""
    schemas = document_schemas()
    from_bodies: set[str] = set()
    for body in (*openapi.RESPONSE_BODIES, *openapi.DIALECT_BODIES):
        for name, schema in openapi.body_schemas(body).items():
            assert schemas[name] == schema, name
            from_bodies.add(name)
    from_requests: set[str] = set()
    for request in openapi.REQUEST_SCHEMAS.values():
        generated = request.model_json_schema(ref_template=openapi.REF_TEMPLATE)
        from_requests |= {request.__name__, *generated.get("$defs", {})}
    # Ollama's, generated from its own models under its prefix (api.dialects.ollama).
    ollama: dict = {}
    ollama_paths(ollama.update)
    for name, schema in ollama.items():
        assert schemas[name] == schema, name
    assert set(schemas) == from_bodies | from_requests | set(ollama)
    # pydantic's JsonValue (any JSON: a tool's parameters, a schema) is the
    # one part a request and an answer share, the same schema either way.
    assert from_bodies & from_requests <= {"JsonValue"}


def test_each_answer_refers_to_its_model():
    """Each endpoint's answer, its stream's events and every error refer to
    the models' schemas."""
    paths = openapi.openapi_document()["paths"]

    def ref(model: type[BaseModel]) -> dict:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    answers = {
        ("/v1/chat/completions", "post"): bodies.ChatCompletion,
        ("/v1/completions", "post"): bodies.Completion,
        ("/v1/embeddings", "post"): bodies.CreateEmbeddingResponse,
        ("/v1/models", "get"): bodies.ModelList,
        ("/v1/files", "post"): bodies.FileObject,
        ("/v1/files", "get"): bodies.FileList,
        ("/v1/files/{file_id}", "get"): bodies.FileObject,
        ("/v1/files/{file_id}", "delete"): bodies.FileDeleted,
        ("/v1/batches", "post"): bodies.Batch,
        ("/v1/batches", "get"): bodies.BatchList,
        ("/v1/batches/{batch_id}", "get"): bodies.Batch,
        ("/v1/batches/{batch_id}/cancel", "post"): bodies.Batch,
    }
    for (path, method), model in answers.items():
        responses = paths[path][method]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"] == ref(model)
        for status, response in responses.items():
            if status != "200":
                schema = response["content"]["application/json"]["schema"]
                assert schema == ref(bodies.ErrorResponse)
    chunks = {
        "/v1/chat/completions": bodies.ChatCompletionChunk,
        "/v1/completions": bodies.CompletionChunk,
    }
    for path, chunk in chunks.items():
        content = paths[path]["post"]["responses"]["200"]["content"]
        data = content["text/event-stream"]["schema"]["properties"]["data"]
        events = data["else"]["contentSchema"]["anyOf"]
        assert events == [ref(chunk), ref(bodies.ErrorResponse)]


def test_keys_left_out_are_not_required_and_nulls_are():
    """A key the API leaves out when it has nothing to say (MISSING) is not
    required; one it sends as null (a default of None) is."""
    schemas = document_schemas()
    assert set(schemas["ChatCompletionChunk"]["required"]) == {
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
    }
    assert "required" not in schemas["ChoiceDelta"]
    assert set(schemas["ChatCompletionMessage"]["required"]) == {"role", "content"}
    assert set(schemas["ChoiceLogprobs"]["required"]) == {"content", "refusal"}
    assert set(schemas["ToolCallDelta"]["required"]) == {"index", "function"}
    assert "timings" in schemas["ChatCompletion"]["required"]


def test_errors_are_the_error_body():
    """What ApiError answers (api.errors) is the ErrorResponse body."""
    for error in (
        errors.model_not_found("m"),
        errors.invalid_request("bad", param="messages"),
        errors.engine_error("internal", "Internal error."),
    ):
        fits(bodies.ErrorResponse, json.loads(error.response().content))


@pytest.mark.django_db
def test_the_batch_apis_answers_are_the_models(settings, tmp_path):
    """The Files and Batch APIs' answers (a file uploaded, read and listed; a
    batch created, read, listed, cancelled, and failed with its errors; the
    file deleted) are the models', key for key, and what the document says;
    so is a refusal (the file of a running batch cannot be deleted)."""
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    client = Client(HTTP_AUTHORIZATION=f"Bearer {ApiKeyFactory().plaintext}")

    def answered(response, model: type[BaseModel], status: int = 200) -> dict:
        assert response.status_code == status, response.content[:300]
        body = json.loads(response.content)
        fits(model, body)
        return body

    upload = SimpleUploadedFile("in.jsonl", b'{"custom_id": "a"}\n')
    form = {"file": upload, "purpose": "batch"}
    stored = answered(client.post("/v1/files", form), bodies.FileObject)
    assert stored["bytes"] == 19
    listed = answered(client.get("/v1/files"), bodies.FileList)
    assert [one["id"] for one in listed["data"]] == [stored["id"]]
    answered(client.get(f"/v1/files/{stored['id']}"), bodies.FileObject)
    request = {
        "input_file_id": stored["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"job": "bodies"},
    }
    created = client.post("/v1/batches", request, content_type="application/json")
    batch = answered(created, bodies.Batch)
    assert (batch["status"], batch["errors"]) == ("validating", None)
    page = answered(client.get("/v1/batches"), bodies.BatchList)
    assert page["first_id"] == page["last_id"] == batch["id"]
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert answered(cancelled, bodies.Batch)["status"] == "cancelling"
    in_use = client.delete(f"/v1/files/{stored['id']}")
    answered(in_use, bodies.ErrorResponse, status=400)
    why = {"code": "batch_crashed", "message": "x", "param": None, "line": None}
    Batch.objects.filter(pk=batch["id"]).update(
        status="failed", failed_at=timezone.now(), errors=[why]
    )
    failed = answered(client.get(f"/v1/batches/{batch['id']}"), bodies.Batch)
    assert failed["errors"] == {"object": "list", "data": [why]}
    deleted = answered(client.delete(f"/v1/files/{stored['id']}"), bodies.FileDeleted)
    assert deleted == {"id": stored["id"], "object": "file", "deleted": True}


# -- the controls ------------------------------------------------------------------


def a_chat_completion() -> dict:
    return bodies.ChatCompletion(
        id="chatcmpl-1",
        created=1_800_000_000,
        model=CHAT,
        choices=[
            bodies.ChatCompletionChoice(
                index=0,
                message=bodies.ChatCompletionMessage(content="Hi."),
                logprobs=None,
                finish_reason="stop",
            )
        ],
        usage={
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        timings={
            "engine": ENGINE,
            "node": "",
            "engine_first_token_ms": 1.5,
            "engine_total_ms": 2.5,
        },
    ).model_dump(mode="json")


def without(body: dict, *path: str | int) -> dict:
    """The body (a copy) without the key at `path`."""
    body = json.loads(json.dumps(body))
    *inside, last = path
    node = body
    for step in inside:
        node = node[step]
    del node[last]
    return body


@pytest.mark.parametrize(
    "path",
    [
        ("choices",),
        ("usage",),
        ("system_fingerprint",),  # sent as null: required all the same
        ("choices", 0, "finish_reason"),
        ("choices", 0, "logprobs"),
        ("choices", 0, "message", "content"),
        ("usage", "prompt_tokens_details", "cached_tokens"),
    ],
)
def test_a_body_missing_a_key_is_refused(path):
    """The control: the check that passes on a whole body fails on the same
    body without one of its keys, by the model and by the document."""
    body = a_chat_completion()
    fits(bodies.ChatCompletion, body)
    broken = without(body, *path)
    assert not is_the_models(bodies.ChatCompletion, broken)
    assert not validator(bodies.ChatCompletion).is_valid(broken)


def test_a_body_with_a_key_of_its_own_or_a_wrong_value_is_refused():
    """A key no model declares, or a value of the wrong kind, fails too."""
    body = a_chat_completion()
    for broken in (
        {**body, "extra": 1},
        {**body, "object": "chat.completion.chunk"},
        {**body, "choices": []},
        {**body, "system_fingerprint": "fp"},
    ):
        with pytest.raises(ValidationError):
            bodies.ChatCompletion.model_validate(broken)
        assert not is_the_models(bodies.ChatCompletion, broken)
        assert not validator(bodies.ChatCompletion).is_valid(broken)


# -- real answers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine serving SmolLM2 (chat) and MiniLM (embeddings)."""
    engine = start_engine(
        tmp_path_factory.mktemp("bodies"),
        models=[gguf_spec(CHAT, "SmolLM2-135M-Instruct.Q4_1.gguf"), embedder_spec()],
        preload=[CHAT, EMBEDDER],
    )
    yield engine
    engine.stop()


@pytest.fixture
def front(engine, tmp_path, settings, own_gateway):
    """The front's API handler, routed to the engine."""
    write_connection_file(tmp_path, name=ENGINE, port=engine.port, token=engine.token)
    settings.RUN_DIR = tmp_path
    snapshot = Snapshot(
        engines={
            ENGINE: EngineStatus(
                ENGINE,
                "cpu",
                frozenset({"gguf", "embedding"}),
                up=True,
                resident=frozenset({CHAT, EMBEDDER}),
            )
        },
        models={
            CHAT: ModelRoute(CHAT, "gguf", task="chat", created=1_800_000_000),
            EMBEDDER: ModelRoute(EMBEDDER, "embedding", task="embedding"),
        },
    )
    own_gateway(lambda: snapshot)
    from roundhouse.asgi import api_application

    return api_application


async def ask(app, key: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request through the ASGI app (a POST of `body`, or a GET): the
    status and the whole body."""
    status, _, answer = await asgi_request(app, key, path, body, timeout=120)
    return status, answer


def events(stream: bytes) -> list[dict]:
    """A stream's events, up to `[DONE]` (which must end it)."""
    data = [e.removeprefix("data: ") for e in stream.decode().split("\n\n") if e]
    assert data[-1] == "[DONE]"
    return [json.loads(event) for event in data[:-1]]


ANSWERS = [
    pytest.param(
        "/v1/chat/completions",
        {
            "messages": ASK,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "max_tokens": 4,
        },
        id="chat-logprobs-n2",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": "required"},
        id="chat-tool-call",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": ["The sea", "A ship"], "echo": True, "logprobs": 2},
        id="completion-echo-logprobs",
    ),
    pytest.param("/v1/completions", {"prompt": "The sea"}, id="completion"),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("path", "fields"), ANSWERS)
async def test_whole_answers_are_the_models(front, path, fields):
    """A whole answer, a chunked one, each of its chunks: the models', key
    for key, and what the document says."""
    key = await sync_to_async(ApiKeyFactory)()
    chat = path == "/v1/chat/completions"
    request = {"model": CHAT, "temperature": 0, "max_tokens": 40, **fields}
    status, answer = await ask(front, key.plaintext, path, request)
    assert status == 200, answer[:300]
    whole = json.loads(answer)
    fits(bodies.ChatCompletion if chat else bodies.Completion, whole)
    if "tools" in fields:
        assert whole["choices"][0]["message"]["tool_calls"]

    streamed = {**request, "stream": True, "stream_options": {"include_usage": True}}
    status, stream = await ask(front, key.plaintext, path, streamed)
    assert status == 200, stream[:300]
    chunks = events(stream)
    for chunk in chunks:
        fits(bodies.ChatCompletionChunk if chat else bodies.CompletionChunk, chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    if "tools" in fields:
        assert any(
            c["choices"] and "tool_calls" in c["choices"][0]["delta"] for c in chunks
        )


@pytest.mark.django_db(transaction=True)
async def test_embeddings_models_and_errors_are_the_models(front):
    """Embeddings (floats and base64), the model list, and an error."""
    key = await sync_to_async(ApiKeyFactory)()
    for encoding in ("float", "base64"):
        request = {
            "model": EMBEDDER,
            "input": ["tides", "harbours"],
            "encoding_format": encoding,
        }
        status, answer = await ask(front, key.plaintext, "/v1/embeddings", request)
        assert status == 200, answer[:300]
        fits(bodies.CreateEmbeddingResponse, json.loads(answer))
    status, answer = await ask(front, key.plaintext, "/v1/models")
    assert status == 200, answer[:300]
    listed = json.loads(answer)
    fits(bodies.ModelList, listed)
    assert {model["id"] for model in listed["data"]} == {CHAT, EMBEDDER}
    request = {"model": "no-such-model", "messages": ASK}
    status, answer = await ask(front, key.plaintext, "/v1/chat/completions", request)
    assert status == 404
    fits(bodies.ErrorResponse, json.loads(answer))
