"""Whole (non-streamed) answers of the generation and embedding endpoints, as
OpenAI's JSON bodies: what a REST request answers and what a Batch API line
records (batches.runner), built by one function each."""

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np

from routing.select import ModelRoute, Snapshot

from . import errors
from .calls import Call
from .pipeline import with_engine
from .schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

__all__ = ["embedding_answer", "finish_reason", "generation_answer"]

Priority = Literal["interactive", "batch"]


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason for the engine's."""
    return "length" if reason == "length" else "stop"


def generation_fields(
    payload: ChatCompletionRequest | CompletionRequest, priority: Priority
) -> dict[str, Any]:
    """The engine request's fields: the body's, our own request id (unique
    across engines and their restarts, which engine ids are not) and the
    priority (a batch line yields to interactive requests in the engine)."""
    fields = payload.engine_fields()
    fields["request_id"] = uuid.uuid4().hex
    if priority != "interactive":
        fields["priority"] = priority
    return fields


async def generation_answer(
    call: Call,
    payload: ChatCompletionRequest | CompletionRequest,
    route: ModelRoute,
    snapshot: Snapshot,
    *,
    chat: bool,
    priority: Priority = "interactive",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Generate on the routed engine; the answer's body and the engine's reply
    (ApiError when it fails)."""
    fields = generation_fields(payload, priority)
    created = int(time.time())
    reply = await with_engine(
        call, route, snapshot, lambda client: client.generate(route.name, **fields)
    )
    call.counted(reply.get("usage", {}))
    reason = finish_reason(reply.get("finish_reason", "stop"))
    text = reply.get("text", "")
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + reply["request_id"],
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": route.name,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": call.usage(),
        "timings": call.timings(reply),
    }
    return body, reply


async def embedding_answer(
    call: Call, payload: EmbeddingRequest, route: ModelRoute, snapshot: Snapshot
) -> dict[str, Any]:
    """Embed on the routed engine; the answer's body (ApiError when it fails,
    or when the model's dimensions are not the ones asked for)."""
    texts = payload.texts()
    rows, prompt_tokens = await with_engine(
        call,
        route,
        snapshot,
        lambda client: client.embed_counted(route.name, texts),
    )
    if payload.dimensions is not None and payload.dimensions != rows.shape[1]:
        raise errors.invalid_request(
            f"The model '{route.name}' returns {rows.shape[1]} dimensions; "
            f"{payload.dimensions} were asked for.",
            param="dimensions",
        )
    call.prompt_tokens = prompt_tokens
    if payload.encoding_format == "base64":
        vectors = [
            base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode()
            for row in rows
        ]
    else:
        vectors = rows.astype(float).tolist()
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": vector}
            for index, vector in enumerate(vectors)
        ],
        "model": route.name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
