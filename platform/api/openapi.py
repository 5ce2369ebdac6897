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

from . import bodies, engine_ops_schemas, errors
from .batch_schemas import BatchRequest
from .dialects import responses_protocol
from .dialects.anthropic import openapi as anthropic_openapi
from .pull_schemas import PullRequest
from .schemas import ENDPOINT_SCHEMAS

# Where a schema's references point: the document's components.
REF_TEMPLATE = "#/components/schemas/{model}"

# The steps of errors.STEP_ERRORS each endpoint runs, by path and method.
GENERATION_STEPS = ("read", "method", "key", "body", "model", "limits", "engine")
# Managing models (api.pulls): a key that may (403 otherwise); what changes
# something is admitted in the key's limits.
MANAGE_STEPS = ("read", "method", "key", "manage")
PULL = "/v1/pulls/{pull_id}"
# The Files and Batch APIs (batches.views): what creates or changes something
# is admitted in the key's limits; reads are not.
KEYED_STEPS = ("read", "method", "key")
FILE = "/v1/files/{file_id}"
BATCH = "/v1/batches/{batch_id}"
ENDPOINT_STEPS: dict[tuple[str, str], tuple[str, ...]] = {
    **{(path, "post"): GENERATION_STEPS for path in ENDPOINT_SCHEMAS},
    ("/v1/models", "get"): ("read", "method", "key"),
    ("/v1/models/{name}", "delete"): (*MANAGE_STEPS, "limits", "lookup", "in_use"),
    ("/v1/pulls", "post"): (*MANAGE_STEPS, "limits", "body", "pull"),
    ("/v1/pulls", "get"): MANAGE_STEPS,
    (PULL, "get"): (*MANAGE_STEPS, "lookup"),
    (PULL, "delete"): (*MANAGE_STEPS, "limits", "lookup"),
    (PULL + "/events", "get"): (*MANAGE_STEPS, "lookup"),
    ("/v1/openapi.json", "get"): ("read", "method"),
    ("/v1/files", "post"): (*KEYED_STEPS, "limits"),
    ("/v1/files", "get"): KEYED_STEPS,
    (FILE, "get"): (*KEYED_STEPS, "lookup"),
    (FILE, "delete"): (*KEYED_STEPS, "limits", "lookup"),
    (FILE + "/content", "get"): (*KEYED_STEPS, "lookup"),
    ("/v1/batches", "post"): (*KEYED_STEPS, "limits", "body", "lookup"),
    ("/v1/batches", "get"): KEYED_STEPS,
    (BATCH, "get"): (*KEYED_STEPS, "lookup"),
    (BATCH + "/cancel", "post"): (*KEYED_STEPS, "limits", "lookup"),
}
# The request bodies, by path and method.
REQUEST_SCHEMAS: dict[tuple[str, str], type[BaseModel]] = {
    **{(path, "post"): schema for path, schema in ENDPOINT_SCHEMAS.items()},
    ("/v1/pulls", "post"): PullRequest,
    ("/v1/batches", "post"): BatchRequest,
}
# The request bodies sent as a form (multipart/form-data), by path and method.
REQUEST_FORMS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/files", "post"): {
        "type": "object",
        "properties": {
            "file": {
                "type": "string",
                "contentMediaType": "application/octet-stream",
                "description": "The batch's requests, one JSON object a line.",
            },
            "purpose": {"const": "batch"},
        },
        "required": ["file", "purpose"],
    },
}

# -- tokenize, detokenize, rerank (api.engine_ops_schemas) ---------------------------
ENGINE_OPS_SCHEMAS: dict[str, type[BaseModel]] = {
    "/tokenize": engine_ops_schemas.TokenizeRequest,
    "/detokenize": engine_ops_schemas.DetokenizeRequest,
    "/v1/tokenize": engine_ops_schemas.TokenizeRequest,
    "/v1/detokenize": engine_ops_schemas.DetokenizeRequest,
    "/v1/rerank": engine_ops_schemas.RerankRequest,
    "/v2/rerank": engine_ops_schemas.RerankRequest,
}
ENGINE_OPS_RESULTS: dict[str, tuple[str, type[bodies.Body]]] = {
    "/tokenize": (
        "The prompt's token ids as a generation evaluates them, their count and "
        "the model's context.",
        engine_ops_schemas.TokenizeResponse,
    ),
    "/detokenize": ("The tokens' text.", engine_ops_schemas.DetokenizeResponse),
    "/v1/rerank": (
        "The documents by relevance to the query, best first.",
        engine_ops_schemas.RerankResponse,
    ),
    "/v2/rerank": (
        "The documents by relevance to the query, best first (Cohere's v2).",
        engine_ops_schemas.RerankV2Response,
    ),
}
ENGINE_OPS_RESULTS["/v1/tokenize"] = ENGINE_OPS_RESULTS["/tokenize"]
ENGINE_OPS_RESULTS["/v1/detokenize"] = ENGINE_OPS_RESULTS["/detokenize"]
ENDPOINT_STEPS.update({(path, "post"): GENERATION_STEPS for path in ENGINE_OPS_SCHEMAS})
REQUEST_SCHEMAS.update(
    {(path, "post"): schema for path, schema in ENGINE_OPS_SCHEMAS.items()}
)
# -- end of tokenize, detokenize, rerank ----------------------------------------------

# The parameters of paths and queries, by path and method.
_PULL_ID = {
    "name": "pull_id",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 1},
}
_FILE_ID = {
    "name": "file_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
}
_BATCH_ID = {
    "name": "batch_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
}
PARAMETERS: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("/v1/models/{name}", "delete"): [
        {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    ],
    ("/v1/pulls", "get"): [
        {
            "name": "limit",
            "in": "query",
            "description": "Pulls per page (default 20).",
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        {
            "name": "after",
            "in": "query",
            "description": "The page after this pull id (a page's `last_id`).",
            "schema": {"type": "integer", "minimum": 1},
        },
    ],
    (PULL, "get"): [_PULL_ID],
    (PULL, "delete"): [_PULL_ID],
    (PULL + "/events", "get"): [_PULL_ID],
    ("/v1/files", "get"): [
        {
            "name": "purpose",
            "in": "query",
            "description": "Only the files of this purpose.",
            "schema": {"type": "string"},
        }
    ],
    **{
        (FILE + tail, method): [_FILE_ID]
        for tail, method in (("", "get"), ("", "delete"), ("/content", "get"))
    },
    ("/v1/batches", "get"): [
        {
            "name": "limit",
            "in": "query",
            "description": "Batches per page (default 20).",
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        {
            "name": "after",
            "in": "query",
            "description": "The page after this batch id (a page's `last_id`).",
            "schema": {"type": "string"},
        },
    ],
    (BATCH, "get"): [_BATCH_ID],
    (BATCH + "/cancel", "post"): [_BATCH_ID],
}
# A success status other than 200.
SUCCESS_STATUS: dict[tuple[str, str], int] = {("/v1/pulls", "post"): 202}

# What a status means, for its description. A status missing here is still
# documented, under its standard phrase.
STATUS_DESCRIPTIONS = {
    400: "Invalid request: the body (the message and `param` name the field), "
    "its Content-Length, or a model used on the wrong endpoint; a file to "
    "delete that a running batch reads.",
    401: "Missing, unknown or revoked API key (a pull: the repository is "
    "gated and this host has no token for it).",
    403: "The API key may not manage models (its 'manages models' is off).",
    404: "Unknown model, or one the key may not use; an unknown pull, or a "
    "pull's repository, file or revision; an unknown file or batch.",
    405: "Wrong method; the Allow header names the right one.",
    409: "A pull's model name is taken, or the model to delete is still "
    "placed or loaded (the message says where).",
    413: "The body is over the size cap (ROUNDHOUSE_MAX_REQUEST_BYTES; an "
    "upload: ROUNDHOUSE_MAX_FILE_BYTES, or its owner's whole storage quota).",
    429: "The key is over its requests per minute or concurrent requests, the "
    "client over its requests with invalid keys, or the engine's queue is full; "
    "an upload or a batch: the owner's storage quota is used up, or the "
    "server's storage is full.",
    500: "The engine failed to serve the request.",
    502: "The engine failed mid-request (a pull: the Hub failed).",
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


def _progress_stream() -> dict[str, Any]:
    """Server-Sent Events: each event's data is the pull as it is now."""
    return {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "properties": {
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": _ref(bodies.ModelPull),
                    }
                },
                "required": ["data"],
            }
        }
    }


def _json(body: type[bodies.Body]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(body)}}


# Each endpoint's answer when it succeeds (by path, and by path and method
# where a path answers several).
RESULTS: dict[str | tuple[str, str], dict[str, Any]] = {
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
    ("/v1/models/{name}", "delete"): {
        "description": "The model was deleted from the catalog, and its files "
        "from this host.",
        "content": _json(bodies.ModelDeleted),
    },
    ("/v1/pulls", "post"): {
        "description": "The pull is queued (its source was read: it exists, "
        "the name is free); follow it at /v1/pulls/{pull_id}/events.",
        "content": _json(bodies.ModelPull),
    },
    ("/v1/pulls", "get"): {
        "description": "A page of pulls, newest first.",
        "content": _json(bodies.ModelPullList),
    },
    (PULL, "get"): {
        "description": "The pull and its progress.",
        "content": _json(bodies.ModelPull),
    },
    (PULL, "delete"): {
        "description": "The pull, cancelled (a running one stops within a "
        "second; a finished one is left as it is).",
        "content": _json(bodies.ModelPull),
    },
    (PULL + "/events", "get"): {
        "description": "The pull each time it changes, until it ends (done, "
        "failed or cancelled).",
        "content": _progress_stream(),
    },
    ("/v1/files", "post"): {
        "description": "The file, stored.",
        "content": _json(bodies.FileObject),
    },
    ("/v1/files", "get"): {
        "description": "The key's files.",
        "content": _json(bodies.FileList),
    },
    (FILE, "get"): {"description": "The file.", "content": _json(bodies.FileObject)},
    (FILE, "delete"): {
        "description": "The file was deleted (and the batches it was the input of).",
        "content": _json(bodies.FileDeleted),
    },
    (FILE + "/content", "get"): {
        "description": "The file's bytes.",
        "content": {
            "application/octet-stream": {
                "schema": {
                    "type": "string",
                    "contentMediaType": "application/octet-stream",
                }
            }
        },
    },
    ("/v1/batches", "post"): {
        "description": "The batch, queued for a worker.",
        "content": _json(bodies.Batch),
    },
    ("/v1/batches", "get"): {
        "description": "A page of the key's batches, newest first.",
        "content": _json(bodies.BatchList),
    },
    (BATCH, "get"): {"description": "The batch.", "content": _json(bodies.Batch)},
    (BATCH + "/cancel", "post"): {
        "description": "The batch, cancelling (its lines in flight end first) "
        "or cancelled; a finished one as it is.",
        "content": _json(bodies.Batch),
    },
}


# tokenize, detokenize, rerank (api.engine_ops_schemas)
RESULTS.update(
    {
        path: {"description": description, "content": _json(body)}
        for path, (description, body) in ENGINE_OPS_RESULTS.items()
    }
)

# -- OpenAI's Responses API (api.dialects.responses) -----------------------------

RESPONSE = "/v1/responses/{response_id}"
_RESPONSE_ID = {
    "name": "response_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
}
ENDPOINT_STEPS.update(
    {
        ("/v1/responses", "post"): (*GENERATION_STEPS, "lookup"),
        (RESPONSE, "get"): ("read", "method", "key", "lookup"),
        (RESPONSE, "delete"): ("read", "method", "key", "limits", "lookup"),
        (RESPONSE + "/input_items", "get"): ("read", "method", "key", "body", "lookup"),
    }
)
REQUEST_SCHEMAS[("/v1/responses", "post")] = responses_protocol.ResponsesRequest
PARAMETERS.update(
    {
        (RESPONSE, "get"): [_RESPONSE_ID],
        (RESPONSE, "delete"): [_RESPONSE_ID],
        (RESPONSE + "/input_items", "get"): [
            _RESPONSE_ID,
            {
                "name": "limit",
                "in": "query",
                "description": "Items per page (default 20).",
                "schema": {"type": "integer", "minimum": 1, "maximum": 100},
            },
            {
                "name": "order",
                "in": "query",
                "description": "asc, or desc (the default: the last item first).",
                "schema": {"enum": ["asc", "desc"]},
            },
            {
                "name": "after",
                "in": "query",
                "description": "The page after this item id (a page's `last_id`).",
                "schema": {"type": "string"},
            },
        ],
    }
)
RESULTS.update(
    {
        "/v1/responses": {
            "description": "The Response object (JSON), or with `stream` its "
            "events (SSE: response.created ... response.completed).",
            "content": {
                **_json(responses_protocol.Response),
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "properties": {
                            "event": {"type": "string"},
                            "data": {
                                "type": "string",
                                "contentMediaType": "application/json",
                                "contentSchema": _ref(responses_protocol.StreamEvent),
                            },
                        },
                        "required": ["data"],
                    }
                },
            },
        },
        (RESPONSE, "get"): {
            "description": "The stored response (the key's own).",
            "content": _json(responses_protocol.Response),
        },
        (RESPONSE, "delete"): {
            "description": "The stored response was deleted.",
            "content": _json(responses_protocol.ResponseDeleted),
        },
        (RESPONSE + "/input_items", "get"): {
            "description": "A page of the items the request sent.",
            "content": _json(responses_protocol.InputItemList),
        },
    }
)
RESPONSE_BODIES = (
    *bodies.RESPONSE_BODIES,
    *engine_ops_schemas.RESPONSE_BODIES,
    *responses_protocol.RESPONSE_BODIES,
)

# -- end of the Responses API ----------------------------------------------------

# -- API dialects (api.dialects): their paths, with their own bodies, key
# headers and error objects ----------------------------------------------------
# A path's error body (else OpenAI's), its security (else bearer), the
# statuses it answers besides its steps', and the response bodies the
# dialects add to the components.
ERROR_BODIES: dict[str, type[bodies.Body]] = {}
SECURITY: dict[str, list[dict[str, list]]] = {}
MORE_ERRORS: dict[str, dict[int, list[errors.Mapping]]] = {}
SECURITY_SCHEMES: dict[str, dict[str, str]] = {
    "bearer": {"type": "http", "scheme": "bearer"}
}
DIALECT_BODIES: list[type[bodies.Body]] = []

# Anthropic's Messages API (api.dialects.anthropic).
for _path, _method in anthropic_openapi.REQUEST_SCHEMAS:
    ENDPOINT_STEPS[(_path, _method)] = GENERATION_STEPS
    ERROR_BODIES[_path] = anthropic_openapi.ERROR_BODY
    SECURITY[_path] = anthropic_openapi.SECURITY
    MORE_ERRORS[_path] = anthropic_openapi.MORE_ERRORS
REQUEST_SCHEMAS.update(anthropic_openapi.REQUEST_SCHEMAS)
RESULTS.update(anthropic_openapi.results(REF_TEMPLATE))
SECURITY_SCHEMES["x-api-key"] = anthropic_openapi.SECURITY_SCHEME
DIALECT_BODIES += [*anthropic_openapi.RESPONSE_BODIES, anthropic_openapi.ERROR_BODY]
STATUS_DESCRIPTIONS[anthropic_openapi.OVERLOADED] = (
    anthropic_openapi.OVERLOADED_DESCRIPTION
)

# -- end of the dialects' block ---------------------------------------------------


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
    for status, mappings in MORE_ERRORS.get(path, {}).items():
        found.setdefault(status, []).extend(mappings)
    return found


def _error_response(
    status: int, mappings: list[errors.Mapping], path: str
) -> dict[str, Any]:
    error_body = ERROR_BODIES.get(path, bodies.ErrorResponse)
    response: dict[str, Any] = {
        "description": STATUS_DESCRIPTIONS.get(status) or HTTPStatus(status).phrase,
        "content": {"application/json": {"schema": _ref(error_body)}},
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
    operation: dict[str, Any] = {"operationId": _operation_id(path, method)}
    steps = ENDPOINT_STEPS[(path, method)]
    if "key" in steps:
        operation["security"] = SECURITY.get(path, [{"bearer": []}])
    if (path, method) in PARAMETERS:
        operation["parameters"] = PARAMETERS[(path, method)]
    schema = REQUEST_SCHEMAS.get((path, method))
    if schema is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(schema)}},
        }
    form = REQUEST_FORMS.get((path, method))
    if form is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"multipart/form-data": {"schema": form}},
        }
    success = str(SUCCESS_STATUS.get((path, method), 200))
    operation["responses"] = {
        success: RESULTS.get((path, method)) or RESULTS[path],
        **{
            str(status): _error_response(status, mappings, path)
            for status, mappings in sorted(endpoint_errors(path, method).items())
        },
    }
    return operation


def _operation_id(path: str, method: str) -> str:
    """The path's words joined by _ (the endpoints that share a path: with
    their method first, get_v1_pulls)."""
    words = path.strip("/").replace("{", "").replace("}", "")
    name = words.replace("/", "_").replace(".", "_")
    shared = sum(1 for other, _ in ENDPOINT_STEPS if other == path) > 1
    return f"{method}_{name}" if shared else name


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document (built once; callers must not change it)."""
    components: dict[str, Any] = {}
    for schema in REQUEST_SCHEMAS.values():
        _add_components(components, model_schemas(schema))
    for body in (*RESPONSE_BODIES, *DIALECT_BODIES):
        _add_components(components, body_schemas(body))
    paths: dict[str, Any] = {}
    for path, method in ENDPOINT_STEPS:
        paths.setdefault(path, {})[method] = _operation(path, method)
    # Ollama's API (/api/...): its own block (api.dialects.ollama.openapi).
    from .dialects.ollama.openapi import ollama_paths

    paths.update(ollama_paths(lambda schemas: _add_components(components, schemas)))
    return {
        "openapi": "3.1.0",
        "info": {"title": "Roundhouse OpenAI-compatible API", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": SECURITY_SCHEMES,
        },
    }
