"""The OpenAPI 3.1 document of the OpenAI-compatible API (`GET /v1/openapi.json`).

Request bodies come from the schemas that validate them (api.schemas), response
bodies from the models the answers are built with (api.bodies). The
statuses an endpoint answers come from the error tables (api.errors.STEP_ERRORS)
and the steps the endpoint runs, so a row added to a table is documented with
no change here.
"""

import functools
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from . import bodies, errors
from .schemas import ENDPOINT_SCHEMAS

# Where a schema's references point: the document's components.
REF_TEMPLATE = "#/components/schemas/{model}"

# The steps of errors.STEP_ERRORS each endpoint runs, by path and method.
GENERATION_STEPS = ("read", "method", "key", "body", "model", "limits", "engine")
ENDPOINT_STEPS: dict[tuple[str, str], tuple[str, ...]] = {
    **{(path, "post"): GENERATION_STEPS for path in ENDPOINT_SCHEMAS},
    ("/v1/models", "get"): ("read", "method", "key"),
    ("/v1/openapi.json", "get"): ("read", "method"),
}

# What a status means, for its description. A status missing here is still
# documented, under its standard phrase.
STATUS_DESCRIPTIONS = {
    400: "Invalid request: the body (the message and `param` name the field), "
    "its Content-Length, or a model used on the wrong endpoint.",
    401: "Missing, unknown or revoked API key.",
    404: "Unknown model, or one the key may not use.",
    405: "Wrong method; the Allow header names the right one.",
    413: "The body is over the size cap (ROUNDHOUSE_MAX_REQUEST_BYTES).",
    429: "The key is over its requests per minute or concurrent requests, the "
    "client over its requests with invalid keys, or the engine's queue is full.",
    500: "The engine failed to serve the request.",
    502: "The engine failed mid-request.",
    503: "Unavailable for now (Retry-After says when to try again): no engine "
    "can serve the model (none serves its format, or all that do are down, "
    "cooling or short of memory), or the database is down and the API key is "
    "not one this front remembers.",
    504: "The engine stopped answering.",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def _stream(chunk: type[bodies.Body]) -> dict[str, Any]:
    """Server-Sent Events: each event's data is a chunk, an error object (the
    engine failed once the stream had started), or `[DONE]`. Before OpenAPI
    3.2, `schema` under text/event-stream describes one event."""
    return {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "properties": {
                    "data": {
                        "type": "string",
                        "if": {"const": "[DONE]"},
                        "else": {
                            "contentMediaType": "application/json",
                            "contentSchema": {
                                "anyOf": [_ref(chunk), _ref(bodies.ErrorResponse)]
                            },
                        },
                    }
                },
                "required": ["data"],
            }
        }
    }


RESULTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "description": "The completion (JSON), or with `stream` its chunks (SSE).",
        "content": {
            "application/json": {"schema": _ref(bodies.ChatCompletion)},
            **_stream(bodies.ChatCompletionChunk),
        },
    },
    "/v1/completions": {
        "description": "The completion (JSON), or with `stream` its chunks (SSE).",
        "content": {
            "application/json": {"schema": _ref(bodies.Completion)},
            **_stream(bodies.CompletionChunk),
        },
    },
    "/v1/embeddings": {
        "description": "One embedding per input, in order.",
        "content": {
            "application/json": {"schema": _ref(bodies.CreateEmbeddingResponse)}
        },
    },
    "/v1/models": {
        "description": "The enabled models this key may use, each once.",
        "content": {"application/json": {"schema": _ref(bodies.ModelList)}},
    },
    "/v1/openapi.json": {
        "description": "This document.",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
}


def model_schemas(model: type[BaseModel], **options: Any) -> dict[str, Any]:
    """A model's JSON Schema and its parts', by name (`options`: pydantic's)."""
    document = model.model_json_schema(ref_template=REF_TEMPLATE, **options)
    return {**document.pop("$defs", {}), model.__name__: document}


def body_schemas(body: type[bodies.Body]) -> dict[str, Any]:
    """A response body's JSON Schema and its parts', by name: the keys it
    sends (api.bodies.BodySchema)."""
    return model_schemas(body, schema_generator=bodies.BodySchema, mode="serialization")


def _add_components(components: dict[str, Any], schemas: dict[str, Any]) -> None:
    """Add schemas to the components; two different schemas of one name are
    a mistake (a response part named as a request's), not one to overwrite."""
    for name, schema in schemas.items():
        if components.setdefault(name, schema) != schema:
            raise ValueError(f"Two different schemas are named {name}.")


def endpoint_errors(path: str, method: str) -> dict[int, list[errors.Mapping]]:
    """Every error row the endpoint's steps can answer, by status."""
    found: dict[int, list[errors.Mapping]] = {}
    for step in ENDPOINT_STEPS[(path, method)]:
        for mapping in errors.STEP_ERRORS[step]:
            found.setdefault(mapping.status, []).append(mapping)
    return found


def _error_response(status: int, mappings: list[errors.Mapping]) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": STATUS_DESCRIPTIONS.get(status, HTTPStatus(status).phrase),
        "content": {"application/json": {"schema": _ref(bodies.ErrorResponse)}},
    }
    headers = {}
    if any(mapping.retry_after_s is not None for mapping in mappings):
        headers["Retry-After"] = {
            "description": "Seconds to wait before trying again.",
            "required": all(m.retry_after_s is not None for m in mappings),
            "schema": {"type": "integer", "minimum": 1},
        }
    if status == errors.METHOD_NOT_ALLOWED.status:
        headers["Allow"] = {
            "description": "The method this path answers.",
            "required": True,
            "schema": {"type": "string"},
        }
    if headers:
        response["headers"] = headers
    return response


def _operation(path: str, method: str) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
    }
    steps = ENDPOINT_STEPS[(path, method)]
    if "key" in steps:
        operation["security"] = [{"bearer": []}]
    schema = ENDPOINT_SCHEMAS.get(path)
    if schema is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(schema)}},
        }
    operation["responses"] = {
        "200": RESULTS[path],
        **{
            str(status): _error_response(status, mappings)
            for status, mappings in sorted(endpoint_errors(path, method).items())
        },
    }
    return operation


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document (built once; callers must not change it)."""
    components: dict[str, Any] = {}
    for schema in ENDPOINT_SCHEMAS.values():
        _add_components(components, model_schemas(schema))
    for body in bodies.RESPONSE_BODIES:
        _add_components(components, body_schemas(body))
    paths: dict[str, Any] = {}
    for path, method in ENDPOINT_STEPS:
        paths.setdefault(path, {})[method] = _operation(path, method)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Roundhouse OpenAI-compatible API", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
