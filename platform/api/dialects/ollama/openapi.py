"""Ollama's paths in /v1/openapi.json (api.openapi adds them): request
bodies from the models that validate them, answers from the models they are
built with (api.dialects.ollama.protocol), statuses from the same error tables and
steps as the OpenAI paths, every error in Ollama's shape but the size cap's
(answered before the request is routed). The protocol's models are named
`Ollama...` in the document, apart from the OpenAI bodies of the same name."""

import json
from typing import Any

from pydantic import BaseModel

from ... import errors
from ...openapi import (
    GENERATION_STEPS,
    MANAGE_STEPS,
    REF_TEMPLATE,
    _error_response,
    body_schemas,
    model_schemas,
)
from . import protocol

NDJSON = "application/x-ndjson"
KEY_STEPS = ("read", "method", "key")
# Path and method: the request body (None: none), the answer, whether it may
# stream (NDJSON, one answer object a line), the steps it runs.
OPERATIONS: dict[tuple[str, str], tuple[Any, Any, bool, tuple[str, ...]]] = {
    ("/api/chat", "post"): (
        protocol.ChatBody,
        protocol.ChatChunk,
        True,
        GENERATION_STEPS,
    ),
    ("/api/generate", "post"): (
        protocol.GenerateBody,
        protocol.GenerateChunk,
        True,
        GENERATION_STEPS,
    ),
    ("/api/embed", "post"): (
        protocol.EmbedBody,
        protocol.EmbedResponse,
        False,
        GENERATION_STEPS,
    ),
    ("/api/embeddings", "post"): (
        protocol.EmbeddingsBody,
        protocol.EmbeddingsResponse,
        False,
        GENERATION_STEPS,
    ),
    ("/api/tags", "get"): (None, protocol.TagsResponse, False, (*KEY_STEPS, "model")),
    ("/api/show", "post"): (
        protocol.ShowBody,
        protocol.ShowResponse,
        False,
        (*KEY_STEPS, "body", "model"),
    ),
    ("/api/ps", "get"): (None, protocol.PsResponse, False, (*KEY_STEPS, "model")),
    ("/api/version", "get"): (None, protocol.VersionResponse, False, ("method",)),
    ("/api/pull", "post"): (
        protocol.PullBody,
        protocol.Progress,
        True,
        (*MANAGE_STEPS, "limits", "body", "pull"),
    ),
}


def _own(name: str) -> bool:
    found = getattr(protocol, name, None)
    return isinstance(found, type) and found.__module__ == protocol.__name__


def _renamed(schemas: dict[str, Any]) -> dict[str, Any]:
    """The protocol's models as `Ollama<Name>`, their references too."""
    text = json.dumps(schemas)
    for name in schemas:
        if _own(name):
            old = REF_TEMPLATE.format(model=name)
            text = text.replace(
                f'"{old}"', f'"{REF_TEMPLATE.format(model="Ollama" + name)}"'
            )
    renamed = json.loads(text)
    return {("Ollama" + k if _own(k) else k): v for k, v in renamed.items()}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    name = model.__name__
    return {"$ref": REF_TEMPLATE.format(model="Ollama" + name if _own(name) else name)}


def _operation(path: str, method: str, add) -> dict[str, Any]:
    request, answer, streams, steps = OPERATIONS[(path, method)]
    name = path.strip("/").replace("/", "_")
    operation: dict[str, Any] = {"operationId": f"ollama_{name.removeprefix('api_')}"}
    if "key" in steps:
        operation["security"] = [{"bearer": []}]
    if request is not None:
        add(_renamed(model_schemas(request)))
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        }
    add(_renamed(body_schemas(answer)))
    content = {"application/json": {"schema": _ref(answer)}}
    if streams:
        content[NDJSON] = {"schema": _ref(answer)}
    found: dict[int, list[errors.Mapping]] = {}
    for step in steps:
        for mapping in errors.STEP_ERRORS[step]:
            found.setdefault(mapping.status, []).append(mapping)
    responses: dict[str, Any] = {
        "200": {
            "description": "The answer; with `stream` (the default where there is "
            "one) NDJSON, one object a line, the last `done` (or an error).",
            "content": content,
        }
    }
    for status, mappings in sorted(found.items()):
        response = _error_response(status, mappings, path)
        if status != errors.TOO_LARGE.status:
            response["content"] = {
                "application/json": {"schema": _ref(protocol.ErrorResponse)}
            }
        responses[str(status)] = response
    add(_renamed(body_schemas(protocol.ErrorResponse)))
    operation["responses"] = responses
    return operation


def ollama_paths(add) -> dict[str, Any]:
    """Ollama's paths; `add` takes their component schemas, by name."""
    paths: dict[str, Any] = {}
    for path, method in OPERATIONS:
        paths.setdefault(path, {})[method] = _operation(path, method, add)
    return paths
