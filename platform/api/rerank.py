"""Rerank through the routed engine: POST /v1/rerank (Cohere's v1 and Jina's
shape) and /v2/rerank (Cohere's v2). A `rerank` model (a cross-encoder)
scores each (query, document) pair; an embedding model answers its cosine
similarity of the query's and each document's embedding. The engine batches
the documents with other callers' (engines/runtime/server.py)."""

import uuid

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from engines.wire.replies import RerankReply, Usage

from .calls import Call
from .engine_ops_schemas import (
    BilledUnits,
    RerankDocumentText,
    RerankMeta,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    RerankV2Response,
)
from .pipeline import with_engine
from .views import serve

__all__ = ["rerank_v1", "rerank_v2"]


async def _reranked(
    call: Call, payload: RerankRequest, *, documents: bool
) -> tuple[str, list[RerankResult], RerankReply]:
    """The answer's id, its results (best first, the `top_n` best; with
    each document's text where `documents`) and the engine's reply."""
    model, texts = call.route.name, payload.texts()
    reply: RerankReply = await with_engine(
        call, lambda client: client.rerank(model, payload.query, texts)
    )
    call.counted(Usage(prompt_tokens=reply.usage.prompt_tokens, completion_tokens=0))
    ranked = sorted(range(len(texts)), key=lambda i: reply.scores[i], reverse=True)
    results = []
    for index in ranked[: payload.top_n]:
        text = {"document": RerankDocumentText(text=texts[index])} if documents else {}
        results.append(
            RerankResult(index=index, relevance_score=reply.scores[index], **text)
        )
    return uuid.uuid4().hex, results, reply


@csrf_exempt
async def rerank_v1(request: HttpRequest) -> HttpResponse:
    """POST /v1/rerank."""

    async def handle(call: Call, payload: RerankRequest) -> HttpResponse:
        documents = payload.return_documents is not False
        answer_id, results, reply = await _reranked(call, payload, documents=documents)
        body = RerankResponse(
            id=answer_id,
            model=call.route.name,
            results=results,
            usage=RerankUsage(total_tokens=reply.usage.prompt_tokens),
        )
        return JsonResponse(body.model_dump(mode="json"))

    return await serve(request, "rerank", RerankRequest, handle)


@csrf_exempt
async def rerank_v2(request: HttpRequest) -> HttpResponse:
    """POST /v2/rerank."""

    async def handle(call: Call, payload: RerankRequest) -> HttpResponse:
        documents = bool(payload.return_documents)
        answer_id, results, _ = await _reranked(call, payload, documents=documents)
        # Cohere bills a search unit per query of up to 100 documents.
        units = -(-len(payload.documents) // 100)
        body = RerankV2Response(
            id=answer_id,
            results=results,
            meta=RerankMeta(billed_units=BilledUnits(search_units=units)),
        )
        return JsonResponse(body.model_dump(mode="json"))

    return await serve(request, "rerank", RerankRequest, handle)
