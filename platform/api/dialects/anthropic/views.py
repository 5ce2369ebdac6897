"""The Messages API's routes: the pipeline's way in (api.views.serve) with
Anthropic's key headers and error shape, then the translated chat request
answered whole or streamed (serving)."""

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from ...calls import Call
from ...models import ApiKey
from ...tokenize import count_prompt_tokens
from ...views import authenticated_by, serve
from .protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    AnthropicTokenCount,
)
from .serving import message_answer, message_stream
from .translation import chat_request, error_response


def api_key(request: HttpRequest) -> str | None:
    """The key as Anthropic's clients send it: `x-api-key` (the SDKs'
    api_key, Claude Code's ANTHROPIC_API_KEY), else `Authorization: Bearer`
    (an auth token, ANTHROPIC_AUTH_TOKEN); as a `Bearer` value."""
    key = request.headers.get("X-Api-Key")
    if key is not None:
        return f"Bearer {key}"
    return request.headers.get("Authorization")


async def _message(call: Call, payload: AnthropicMessagesRequest) -> HttpResponse:
    chat = chat_request(payload)
    if payload.stream:
        return await message_stream(call, chat)
    return await message_answer(call, chat)


async def _count_tokens(
    call: Call, payload: AnthropicCountTokensRequest
) -> HttpResponse:
    # api.tokenize counts through the routed engine.
    count = await count_prompt_tokens(call, chat_request(payload))
    return HttpResponse(
        AnthropicTokenCount(input_tokens=count).model_dump_json(),
        content_type="application/json",
    )


async def _caller(request: HttpRequest) -> ApiKey:
    """The live key, sent as Anthropic's clients send it (`x-api-key`) or as
    a bearer token."""
    return await authenticated_by(request, api_key)


@csrf_exempt
async def messages(request: HttpRequest) -> HttpResponse:
    """POST /v1/messages."""
    return await serve(
        request,
        "messages",
        AnthropicMessagesRequest,
        _message,
        caller=_caller,
        framed=error_response,
    )


@csrf_exempt
async def count_tokens(request: HttpRequest) -> HttpResponse:
    """POST /v1/messages/count_tokens."""
    return await serve(
        request,
        "messages.count_tokens",
        AnthropicCountTokensRequest,
        _count_tokens,
        caller=_caller,
        framed=error_response,
    )
