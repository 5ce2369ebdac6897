"""What the Messages API adds to /v1/openapi.json (api.openapi reads it): its
paths run the same steps as the chat endpoints, with their own bodies, their
key header and Anthropic's error object; an engine's full queue is its 529."""

from typing import Any

from ... import errors
from ...bodies import Body
from .protocol import (
    STREAM_EVENTS,
    AnthropicCountTokensRequest,
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicTokenCount,
)
from .translation import OVERLOADED

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
REQUEST_SCHEMAS = {
    (MESSAGES, "post"): AnthropicMessagesRequest,
    (COUNT_TOKENS, "post"): AnthropicCountTokensRequest,
}
RESPONSE_BODIES: tuple[type[Body], ...] = (
    AnthropicMessage,
    AnthropicTokenCount,
    *STREAM_EVENTS,
)
ERROR_BODY = AnthropicErrorResponse
# The key as Anthropic's clients send it, or as a bearer token.
SECURITY = [{"x-api-key": []}, {"bearer": []}]
SECURITY_SCHEME = {"type": "apiKey", "in": "header", "name": "x-api-key"}
# Statuses besides the steps' (errors.STEP_ERRORS).
MORE_ERRORS = {
    OVERLOADED: [
        errors.Mapping(OVERLOADED, "overloaded_error", retry_after_s=1),
    ]
}
OVERLOADED_DESCRIPTION = "The engine's queue is full (Anthropic's 'overloaded')."


def _ref(model: type[Body], template: str) -> dict[str, str]:
    return {"$ref": template.format(model=model.__name__)}


def results(template: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Each path's answer when it succeeds (`template`: where references point)."""
    event_names = [model.model_fields["type"].default for model in STREAM_EVENTS]
    stream = {
        "schema": {
            "type": "object",
            "properties": {
                "event": {"type": "string", "enum": event_names},
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {
                        "anyOf": [_ref(event, template) for event in STREAM_EVENTS]
                    },
                },
            },
            "required": ["event", "data"],
        }
    }
    return {
        (MESSAGES, "post"): {
            "description": "The message (JSON), or with `stream` its events (SSE).",
            "content": {
                "application/json": {"schema": _ref(AnthropicMessage, template)},
                "text/event-stream": stream,
            },
        },
        (COUNT_TOKENS, "post"): {
            "description": "The prompt's tokens (system, tools and messages).",
            "content": {
                "application/json": {"schema": _ref(AnthropicTokenCount, template)}
            },
        },
    }
