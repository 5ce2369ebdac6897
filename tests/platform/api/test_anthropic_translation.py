"""Anthropic's Messages bodies translated onto the chat request, and the
pipeline's errors into Anthropic's (no engine: the translation alone)."""

import json

import pytest

from api import errors, openapi
from api.dialects.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
)
from api.dialects.anthropic.translation import (
    ERROR_TYPES,
    anthropic_error,
    chat_request,
    error_response,
)
from api.schemas import parse
from engines.wire.errors import ErrorCode
from tests.platform.api.chat_front import chat_scope
from tests.platform.api.test_openapi import pipeline_errors

TOOL = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def engine_request(body: dict, schema=AnthropicMessagesRequest):
    payload = parse(schema, json.dumps(body).encode())
    return chat_request(payload).engine_requests()[0]


def refusal(body: dict) -> dict:
    with pytest.raises(errors.ApiError) as refused:
        engine_request(body)
    status, answer = anthropic_error(refused.value)
    assert status == 400
    return answer.model_dump()["error"]


def test_a_conversation_with_a_tool_round_trip_becomes_chat_turns():
    """The system prompt first (its blocks joined), the assistant's tool_use
    as its tool call (input as JSON arguments), each tool_result a tool turn
    before the user's text; thinking blocks dropped; sampling, stop
    sequences, top_k and tool choice carried over."""
    request = engine_request(
        {
            "model": "m",
            "max_tokens": 9,
            "system": [
                {"type": "text", "text": "Be brief."},
                {"type": "text", "text": "Be kind."},
            ],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {
                            "type": "text",
                            "text": "Thanks.",
                            "cache_control": {"type": "ephemeral"},
                        },
                    ],
                },
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "temperature": 0.5,
            "top_k": 7,
            "stop_sequences": ["###"],
            "metadata": {"user_id": "u"},
        }
    )
    turns = [turn.model_dump(exclude_none=True) for turn in request.messages]
    assert turns == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "Thanks."},
    ]
    assert (request.max_tokens, request.temperature, request.top_k) == (9, 0.5, 7)
    assert request.stop == ["###"]
    assert request.tool_choice == "required"
    assert request.parallel_tool_calls is False
    assert [tool.name for tool in request.tools] == ["get_weather"]


def test_a_named_tool_choice_and_count_tokens_bodies():
    """tool_choice `tool` names the function; a count_tokens body makes the
    same prompt, with no answer limit of its own."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    counted = engine_request(body, AnthropicCountTokensRequest)
    assert counted.tool_choice.name == "get_weather"
    assert counted.max_tokens is None
    answered = engine_request({**body, "max_tokens": 3})
    assert answered.messages == counted.messages


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"messages": [{"role": "assistant", "content": "Sure"}]}, "prefill"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {}}]}
                ]
            },
            "image blocks are not supported",
        ),
        ({"tools": [{**TOOL, "type": "web_search_20250305"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "any"}}, "needs `tools`"),
        ({"temperature": 1.5}, "temperature"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(change, said):
    """Each refusal is a 400 invalid_request_error that says what is wrong."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    body.update(change)
    body = {key: value for key, value in body.items() if value is not None}
    error = refusal(body)
    assert error["type"] == "invalid_request_error"
    assert said in error["message"]


def test_every_pipeline_error_has_an_anthropic_type():
    """Every status the pipeline answers has Anthropic's error type, and an
    engine's full queue is Anthropic's 529 overloaded_error; each error keeps
    its Retry-After."""
    for error in pipeline_errors():
        assert error.status in ERROR_TYPES, error
        status, body = anthropic_error(error)
        assert body.error.message == error.message
        response = error_response(error)
        assert response.status_code == status
        assert json.loads(response.content)["type"] == "error"
        if error.retry_after_s is not None:
            assert response["Retry-After"] == str(error.retry_after_s)
    overloaded = errors.engine_error(ErrorCode.OVERLOADED, "queue full")
    assert anthropic_error(overloaded)[0] == 529
    assert anthropic_error(overloaded)[1].error.type == "overloaded_error"
    # The control: a caller over its limits is a 429, not an overload.
    over = anthropic_error(errors.rate_limited("over rpm", 3))
    assert (over[0], over[1].error.type) == (429, "rate_limit_error")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_the_document_lists_every_status_in_anthropics_shape(path):
    """The Messages paths document each status their errors can have (529
    too), with Anthropic's error body, and both key headers."""
    operation = openapi.openapi_document()["paths"][path]["post"]
    documented = {int(status) for status in operation["responses"]}
    answered = {anthropic_error(error)[0] for error in pipeline_errors()}
    assert answered | {200, 529} <= documented
    assert {"x-api-key": []} in operation["security"]
    error_schema = operation["responses"]["400"]["content"]["application/json"]
    assert error_schema["schema"]["$ref"].endswith("/AnthropicErrorResponse")


async def test_a_body_over_the_cap_is_refused_in_each_dialects_shape(settings):
    """The size cap refuses a Messages body before its view, in Anthropic's
    error shape, and an Ollama body in Ollama's (`{"error": "..."}`); the
    control: an OpenAI path's in OpenAI's."""
    from roundhouse.asgi import api_application

    settings.ROUNDHOUSE_MAX_REQUEST_BYTES = 1000

    async def refused(path: str) -> tuple[int, dict]:
        scope = chat_scope("rh-key", b"", path=path)
        scope["headers"] = [(b"content-length", b"5000")]
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await api_application(scope, receive, send)
        body = b"".join(m.get("body", b"") for m in sent)
        return sent[0]["status"], json.loads(body)

    status, body = await refused("/v1/messages")
    assert status == 413
    assert body["type"] == "error"
    assert body["error"]["type"] == "request_too_large"
    status, body = await refused("/api/chat")
    assert status == 413
    assert set(body) == {"error"} and "the limit is 1000 bytes" in body["error"]
    status, body = await refused("/v1/chat/completions")
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
