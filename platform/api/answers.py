"""Whole (non-streamed) answers of the generation and embedding endpoints, as
OpenAI's JSON bodies: what a REST request answers and what a Batch API line
records (batches.runner), built by one function each."""

import asyncio
import base64
import time
from typing import Any

import numpy as np

from engines.wire.replies import GenerateAnswer, Usage
from engines.wire.requests import GenerateRequest

from . import bodies, errors
from .calls import Call
from .choices import (
    ChoicesUsage,
    Priority,
    call_requests,
    chat_logprobs,
    chat_message,
    completion_logprobs,
    finish_reason,
)
from .pipeline import with_engine
from .schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

__all__ = ["embedding_answer", "generation_answer"]


async def generation_answer(
    call: Call,
    payload: ChatCompletionRequest | CompletionRequest,
    *,
    chat: bool,
    priority: Priority = "interactive",
) -> tuple[dict[str, Any], GenerateAnswer]:
    """Generate every choice on the routed engine (each in a slot of its
    batch); the answer's body and the first choice's engine reply (ApiError
    when any fails: the others are cancelled)."""
    requests = call_requests(payload, priority, call=call)
    created = int(time.time())

    async def one(request: GenerateRequest) -> GenerateAnswer:
        return await with_engine(call, lambda client: client.generate(request))

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(request)) for request in requests]
    except ExceptionGroup as failed:  # the first failure is the answer's
        raise failed.exceptions[0] from None
    replies = [task.result() for task in tasks]
    usage_count = ChoicesUsage(per_prompt=payload.choices_per_prompt)
    for index, reply in enumerate(replies):
        usage_count.ended(index, reply.usage)
    call.counted(usage_count.usage())
    choices: list[bodies.ChatCompletionChoice | bodies.CompletionChoice] = []
    for index, (request, reply) in enumerate(zip(requests, replies, strict=True)):
        reason = finish_reason(reply.finish_reason)
        entries = reply.logprobs
        if chat:
            choice = bodies.ChatCompletionChoice(
                index=index,
                message=chat_message(reply),
                logprobs=chat_logprobs(entries) if entries is not None else None,
                finish_reason=reason,
            )
        else:
            echoed = _echoed(request, reply) if payload.echo else ""
            logprobs = None
            if entries is not None:
                # Echoed, the prompt's tokens come first (from offset 0).
                scored = (reply.prompt_logprobs or []) + entries
                offset = 0 if payload.echo else len(echoed)
                logprobs, _ = completion_logprobs(scored, offset)
            choice = bodies.CompletionChoice(
                index=index,
                text=echoed + reply.text,
                logprobs=logprobs,
                finish_reason=reason,
            )
        choices.append(choice)
    answer = bodies.ChatCompletion if chat else bodies.Completion
    body = answer(
        id=("chatcmpl-" if chat else "cmpl-") + replies[0].request_id,
        created=created,
        model=call.model,
        choices=choices,
        usage=call.usage(),
        timings=call.timings(replies[0]),
    )
    return body.model_dump(mode="json"), replies[0]


def _echoed(request: GenerateRequest, reply: GenerateAnswer) -> str:
    """A completion's prompt as echoed: its text as sent, or the text of the
    tokens it was sent as (the engine's)."""
    if request.prompt is not None:
        return request.prompt
    return reply.prompt_text or ""


async def embedding_answer(
    call: Call, payload: EmbeddingRequest, *, keep_alive_s: float | None = None
) -> dict[str, Any]:
    """Embed on the routed engine; the answer's body (ApiError when it fails,
    or when the model's dimensions are not the ones asked for).
    `keep_alive_s`: how long the model may then stay idle (Ollama's
    keep_alive; None: its own keep-alive)."""
    texts, route = payload.texts(), call.route
    rows, header = await with_engine(
        call,
        lambda client: client.embed_counted(
            route.name, texts, keep_alive_s=keep_alive_s
        ),
    )
    prompt_tokens = header.usage.prompt_tokens
    call.load_ms = header.load_ms or 0.0
    if payload.dimensions is not None and payload.dimensions != rows.shape[1]:
        raise errors.invalid_request(
            f"The model '{route.name}' returns {rows.shape[1]} dimensions; "
            f"{payload.dimensions} were asked for.",
            param="dimensions",
        )
    call.counted(Usage(prompt_tokens=prompt_tokens, completion_tokens=0))
    if payload.encoding_format == "base64":
        vectors = [
            base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode()
            for row in rows
        ]
    else:
        vectors = rows.astype(float).tolist()
    body = bodies.CreateEmbeddingResponse(
        data=[
            bodies.Embedding(index=index, embedding=vector)
            for index, vector in enumerate(vectors)
        ],
        model=route.name,
        usage=bodies.EmbeddingUsage(
            prompt_tokens=prompt_tokens, total_tokens=prompt_tokens
        ),
    )
    return body.model_dump(mode="json")
