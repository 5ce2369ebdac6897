"""Tokenize and detokenize through the routed engine (vLLM's /tokenize and
/detokenize; llama.cpp server's `content` for `prompt`), and the prompt-token
count other endpoints answer without generating (Anthropic's count_tokens).

A prompt is counted by the engine that would generate it, rendered and
tokenized as a generation renders it (engines/generation/context.py
`prompt_tokens`): the count is the `usage.prompt_tokens` a generation of the
same request reports (unless its model drops old turns to fit). Neither
endpoint evaluates anything: their usage rows count no tokens."""

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from engines.wire.replies import TokenizeReply
from engines.wire.requests import TokenizeRequest as EngineTokenize

from .calls import Call
from .engine_ops_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from .pipeline import with_engine
from .schemas import ChatCompletionRequest, CompletionRequest
from .views import serve

__all__ = ["count_prompt_tokens", "detokenize", "tokenize"]

# What of a generation's fields shapes its prompt (the rest is sampling).
_PROMPT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


async def count_prompt_tokens(
    call: Call, request: ChatCompletionRequest | CompletionRequest
) -> int:
    """The prompt tokens the model would evaluate for `request` (its chat
    template applied, its tools included; every prompt of a completions
    list, one sent as token ids as it is), counted by an engine routed to as
    a generation is (the call must be admitted: api.pipeline.call_admitted)."""
    total = 0
    for prompt in request.engine_prompts():
        if "prompt_tokens" in prompt:
            total += len(prompt["prompt_tokens"])
        else:
            total += (await _tokenized(call, request, prompt)).count
    return total


async def _tokenized(
    call: Call,
    request: ChatCompletionRequest | CompletionRequest,
    prompt: dict[str, Any],
    *,
    add_generation_prompt: bool = True,
) -> TokenizeReply:
    """One prompt of `request` (one of its engine_prompts) tokenized by the
    call's engine, with the tools the request offers."""
    assert call.route is not None, "call_admitted first"
    fields = request.engine_fields() if getattr(request, "tools", None) else {}
    shared = {name: fields[name] for name in _PROMPT_FIELDS if name in fields}
    if not add_generation_prompt:
        shared["add_generation_prompt"] = False
    message = EngineTokenize.model_construct(model=call.route.name, **prompt, **shared)
    return await with_engine(call, lambda client: client.tokenize(message))


@csrf_exempt
async def tokenize(request: HttpRequest) -> HttpResponse:
    """POST /tokenize (and /v1/tokenize)."""

    async def handle(call: Call, payload: TokenizeRequest) -> HttpResponse:
        generation = payload.generation()
        (prompt,) = generation.engine_prompts()
        reply = await _tokenized(
            call,
            generation,
            prompt,
            add_generation_prompt=payload.add_generation_prompt,
        )
        body = TokenizeResponse(
            count=reply.count, max_model_len=reply.max_model_len, tokens=reply.tokens
        )
        return JsonResponse(body.model_dump(mode="json"))

    return await serve(request, "tokenize", TokenizeRequest, handle)


@csrf_exempt
async def detokenize(request: HttpRequest) -> HttpResponse:
    """POST /detokenize (and /v1/detokenize)."""

    async def handle(call: Call, payload: DetokenizeRequest) -> HttpResponse:
        model = call.route.name
        reply = await with_engine(
            call, lambda client: client.detokenize(model, payload.tokens)
        )
        return JsonResponse(DetokenizeResponse(prompt=reply.text).model_dump())

    return await serve(request, "detokenize", DetokenizeRequest, handle)
