"""The routes of Ollama's API (mounted at /api/): each runs the pipeline's
steps as api.views does (key, typed body, call_admitted, the engine, one
usage row under its `ollama.*` endpoint), with the key of access.ollama_key
and every refusal in Ollama's shape (`{"error": "..."}`, the same status)."""

from collections.abc import Awaitable, Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel

from ... import errors
from ...calls import Call, after_answer
from ...gateway import front_gateway
from ...pipeline import api_error
from ...schemas import parse
from ...selectors import in_db_thread
from ...services import api_key_allows
from ...views import method_refused, serve
from . import listing, protocol, pulling, serving
from .access import ollama_key, refusal

# The Ollama release whose API this follows, for tools that check it.
OLLAMA_VERSION = "0.12.0"


def _method_refused(request: HttpRequest, allowed: str) -> HttpResponse | None:
    return method_refused(request, allowed, refusal)


async def _serve(
    request: HttpRequest,
    endpoint: str,
    schema: type[BaseModel],
    handler: Callable[[Call, Any], Awaitable[HttpResponse]],
) -> HttpResponse:
    """api.views.serve with Ollama's key (access.ollama_key) and its error
    shape."""
    return await serve(
        request, endpoint, schema, handler, caller=ollama_key, framed=refusal
    )


@csrf_exempt
async def chat(request: HttpRequest) -> HttpResponse:
    """POST /api/chat."""

    async def handle(call: Call, body: protocol.ChatBody) -> HttpResponse:
        if not body.messages:
            return await serving.loaded(call, body, chat=True)
        payload = serving.chat_request(body)
        return await serving.generation(call, payload, stream=body.stream, chat=True)

    return await _serve(request, "ollama.chat", protocol.ChatBody, handle)


@csrf_exempt
async def generate(request: HttpRequest) -> HttpResponse:
    """POST /api/generate."""

    async def handle(call: Call, body: protocol.GenerateBody) -> HttpResponse:
        if not body.prompt and not body.images:
            return await serving.loaded(call, body, chat=False)
        task = call.route.task if call.route is not None else "chat"
        payload = serving.generate_request(body, task=task)
        return await serving.generation(call, payload, stream=body.stream, chat=False)

    return await _serve(request, "ollama.generate", protocol.GenerateBody, handle)


@csrf_exempt
async def embed(request: HttpRequest) -> HttpResponse:
    """POST /api/embed."""

    async def handle(call: Call, body: protocol.EmbedBody) -> HttpResponse:
        payload = serving.embedding_request(body)
        return await serving.embedding(
            call, payload, legacy=False, keep_alive_s=body.keep_alive
        )

    return await _serve(request, "ollama.embed", protocol.EmbedBody, handle)


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse:
    """POST /api/embeddings (Ollama's older one-prompt endpoint)."""

    async def handle(call: Call, body: protocol.EmbeddingsBody) -> HttpResponse:
        payload = serving.embedding_request(body)
        return await serving.embedding(
            call, payload, legacy=True, keep_alive_s=body.keep_alive
        )

    return await _serve(request, "ollama.embed", protocol.EmbeddingsBody, handle)


# -- the catalog and the fleet --------------------------------------------------------


async def _allowed_names(key) -> list[str]:
    snapshot = await front_gateway().snapshot()
    return sorted(
        name for name in snapshot.models if api_key_allows(key=key, model=name)
    )


def _json(body: BaseModel) -> JsonResponse:
    return JsonResponse(body.model_dump(mode="json"))


async def _keyed(
    request: HttpRequest, method: str, answer: Callable[[Any], Awaitable[HttpResponse]]
) -> HttpResponse:
    """A read of the catalog or the fleet: the method, the key, the answer;
    any failure in Ollama's shape."""
    refused = _method_refused(request, method)
    if refused is not None:
        return refused
    try:
        key = await ollama_key(request)
        response = await answer(key)
    except Exception as error:
        return refusal(api_error(error, what=request.path))
    after_answer()
    return response


async def tags(request: HttpRequest) -> HttpResponse:
    """GET /api/tags: the enabled models the key may use."""

    async def answer(key) -> HttpResponse:
        names = await _allowed_names(key)
        return _json(await in_db_thread(listing.tags)(names=names))

    return await _keyed(request, "GET", answer)


@csrf_exempt
async def show(request: HttpRequest) -> HttpResponse:
    """POST /api/show: a model's card (404 for one the key may not use)."""

    async def answer(key) -> HttpResponse:
        body = parse(protocol.ShowBody, request.body)
        name = body.named
        if name not in await _allowed_names(key):
            raise errors.model_not_found(name)
        found = await in_db_thread(listing.show)(name=name)
        if found is None:
            raise errors.model_not_found(name)
        return _json(found)

    return await _keyed(request, "POST", answer)


async def ps(request: HttpRequest) -> HttpResponse:
    """GET /api/ps: the models the key may use that an engine holds now, and
    where."""

    async def answer(key) -> HttpResponse:
        allowed = set(await _allowed_names(key))
        return _json(await in_db_thread(listing.running)(allowed=allowed))

    return await _keyed(request, "GET", answer)


async def version(request: HttpRequest) -> HttpResponse:
    """GET /api/version (no key needed, as with Ollama)."""
    refused = _method_refused(request, "GET")
    if refused is not None:
        return refused
    return _json(protocol.VersionResponse(version=OLLAMA_VERSION))


@csrf_exempt
async def pull(request: HttpRequest) -> HttpResponse:
    """POST /api/pull: a key that manages models only."""

    async def answer(key) -> HttpResponse:
        body = parse(protocol.PullBody, request.body)
        return await pulling.pull_answer(key, body)

    return await _keyed(request, "POST", answer)


async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Unknown /api/ paths (Ollama's create, copy, push, delete, blobs among
    them) answer in Ollama's shape."""
    return refusal(
        errors.from_mapping(
            errors.NOT_FOUND,
            f"{request.path} is not served here (Roundhouse serves Ollama's "
            "chat, generate, embed, embeddings, tags, show, ps, version and pull).",
            code=errors.ApiCode.UNKNOWN_URL,
        )
    )
