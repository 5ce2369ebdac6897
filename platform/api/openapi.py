"""The OpenAPI 3.1 document of the OpenAI-compatible API (`GET /v1/openapi.json`).

Request bodies come from the schemas that validate them (api.schemas). The
statuses an endpoint answers come from the error tables (api.errors.STEP_ERRORS)
and the steps the endpoint runs, so a row added to a table is documented with
no change here.
"""

import functools
from http import HTTPStatus
from typing import Any

from . import errors
from .schemas import ENDPOINT_SCHEMAS, MAX_CHOICES

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

# Response bodies (not in api.schemas: the views build them).
USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {
            "type": "object",
            "description": "cached_tokens: prompt tokens taken from a slot's "
            "prompt cache instead of evaluated again.",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
            "required": ["cached_tokens"],
        },
    },
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
}
TIMINGS = {
    "type": "object",
    "description": "Roundhouse's addition: the engine that answered (and its "
    "node, on a cluster) and its own times from the request's arrival.",
    "properties": {
        "engine": {"type": "string"},
        "node": {"type": "string"},
        "engine_first_token_ms": {"type": ["number", "null"]},
        "engine_total_ms": {"type": ["number", "null"]},
    },
    "required": ["engine"],
}
FINISH_REASON = {"enum": ["stop", "length", "tool_calls"]}
_TOKEN = {
    "token": {"type": "string"},
    "logprob": {"type": "number", "maximum": 0},
    "bytes": {"type": "array", "items": {"type": "integer"}},
}
# Log-probabilities: chat's shape, and completions' (legacy) one.
CHAT_LOGPROBS = {
    "type": ["object", "null"],
    "properties": {
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    **_TOKEN,
                    "top_logprobs": {
                        "type": "array",
                        "items": {"type": "object", "properties": _TOKEN},
                    },
                },
                "required": ["token", "logprob", "bytes", "top_logprobs"],
            },
        },
        "refusal": {"type": "null"},
    },
}
COMPLETION_LOGPROBS = {
    "type": ["object", "null"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        # An echoed prompt's first token has neither (null).
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {
            "type": "array",
            "items": {
                "type": ["object", "null"],
                "additionalProperties": {"type": "number"},
            },
        },
        "text_offset": {"type": "array", "items": {"type": "integer"}},
    },
}
_FUNCTION = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
}
TOOL_CALLS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {**_FUNCTION, "required": ["name", "arguments"]},
        },
        "required": ["id", "type", "function"],
    },
}
TOOL_CALL_DELTAS = {
    "type": "array",
    "description": "A call's id, type and name in its first delta; its "
    "arguments in pieces.",
    "items": {
        "type": "object",
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": _FUNCTION,
        },
        "required": ["index", "function"],
    },
}


def _completion(
    object_name: str,
    choice: dict[str, Any],
    required: list[str],
    logprobs: dict[str, Any],
) -> dict[str, Any]:
    """A completion's body: its choices (`n` per prompt), with the usage of
    them all and timings."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": "null"},
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_CHOICES,
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        **choice,
                        "logprobs": logprobs,
                        "finish_reason": FINISH_REASON,
                    },
                    "required": ["index", *required, "finish_reason"],
                },
            },
            "usage": {"$ref": "#/components/schemas/Usage"},
            "timings": {"$ref": "#/components/schemas/Timings"},
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    }


def _chunk(
    object_name: str, choice: dict[str, Any], logprobs: dict[str, Any]
) -> dict[str, Any]:
    """A streamed chunk: one choice's delta (its finish reason and timings in
    its last), or with `include_usage` a last chunk with no choice and the
    usage of them all."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": "null"},
            "choices": {
                "type": "array",
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        **choice,
                        "logprobs": logprobs,
                        "finish_reason": {"enum": [None, *FINISH_REASON["enum"]]},
                    },
                    "required": ["index", *choice, "finish_reason"],
                },
            },
            "usage": {
                "oneOf": [{"$ref": "#/components/schemas/Usage"}, {"type": "null"}]
            },
            "timings": {"$ref": "#/components/schemas/Timings"},
        },
        "required": ["id", "object", "created", "model", "choices"],
    }


def _stream(chunk: str) -> dict[str, Any]:
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
                                "anyOf": [
                                    {"$ref": f"#/components/schemas/{chunk}"},
                                    {"$ref": "#/components/schemas/Error"},
                                ]
                            },
                        },
                    }
                },
                "required": ["data"],
            }
        }
    }


RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "Usage": USAGE,
    "Timings": TIMINGS,
    "ChatCompletion": _completion(
        "chat.completion",
        {
            "message": {
                "type": "object",
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},
                    "tool_calls": TOOL_CALLS,
                },
                "required": ["role", "content"],
            }
        },
        ["message"],
        CHAT_LOGPROBS,
    ),
    "TextCompletion": _completion(
        "text_completion",
        {"text": {"type": "string"}},
        ["text"],
        COMPLETION_LOGPROBS,
    ),
    "ChatCompletionChunk": _chunk(
        "chat.completion.chunk",
        {
            "delta": {
                "type": "object",
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": "string"},
                    "tool_calls": TOOL_CALL_DELTAS,
                },
            }
        },
        CHAT_LOGPROBS,
    ),
    "TextCompletionChunk": _chunk(
        "text_completion", {"text": {"type": "string"}}, COMPLETION_LOGPROBS
    ),
    "EmbeddingList": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "object": {"const": "embedding"},
                        "index": {"type": "integer", "minimum": 0},
                        "embedding": {
                            "description": "Floats, or with encoding_format "
                            "base64 little-endian float32 in base64.",
                            "oneOf": [
                                {"type": "array", "items": {"type": "number"}},
                                {"type": "string"},
                            ],
                        },
                    },
                    "required": ["object", "index", "embedding"],
                },
            },
            "model": {"type": "string"},
            "usage": {
                "type": "object",
                "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 0},
                    "total_tokens": {"type": "integer", "minimum": 0},
                },
                "required": ["prompt_tokens", "total_tokens"],
            },
        },
        "required": ["object", "data", "model", "usage"],
    },
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "model"},
                        "created": {"type": "integer"},
                        "owned_by": {"type": "string"},
                    },
                    "required": ["id", "object", "created", "owned_by"],
                },
            },
        },
        "required": ["object", "data"],
    },
    "Error": {
        "type": "object",
        "description": "OpenAI's error object.",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                "required": ["message", "type", "param", "code"],
            }
        },
        "required": ["error"],
    },
}

RESULTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "description": "The completion (JSON), or with `stream` its chunks (SSE).",
        "content": {
            "application/json": {
                "schema": {"$ref": "#/components/schemas/ChatCompletion"}
            },
            **_stream("ChatCompletionChunk"),
        },
    },
    "/v1/completions": {
        "description": "The completion (JSON), or with `stream` its chunks (SSE).",
        "content": {
            "application/json": {
                "schema": {"$ref": "#/components/schemas/TextCompletion"}
            },
            **_stream("TextCompletionChunk"),
        },
    },
    "/v1/embeddings": {
        "description": "One embedding per input, in order.",
        "content": {
            "application/json": {
                "schema": {"$ref": "#/components/schemas/EmbeddingList"}
            }
        },
    },
    "/v1/models": {
        "description": "The enabled models this key may use, each once.",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ModelList"}}
        },
    },
    "/v1/openapi.json": {
        "description": "This document.",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
}


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
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
        },
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
            "content": {
                "application/json": {
                    "schema": {"$ref": f"#/components/schemas/{schema.__name__}"}
                }
            },
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
        document = schema.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(document.pop("$defs", {}))
        components[schema.__name__] = document
    components.update(RESPONSE_SCHEMAS)
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
