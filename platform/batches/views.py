"""The Files and Batch APIs, as OpenAI shapes them (the official client's
`files` and `batches` calls work unchanged). Every call needs an API key; a
key sees its owner's files and batches (or, with no owner, its own). Calls
that create (an upload, a batch, a cancel) are admitted in the key's live
rate and concurrency budget, as its REST requests are (429 over); reads are
not, so that polling a batch never uses up a key's requests."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from api import bodies, errors
from api.batch_schemas import BatchRequest
from api.models import ApiKey
from api.pipeline import api_error, authenticate, keyed_request
from api.schemas import parse
from api.selectors import in_db_thread

from . import quotas, selectors, services
from .models import Batch, StoredFile

log = logging.getLogger("roundhouse.batches")

CHUNK_BYTES = 1 << 20
# What a multipart upload to /v1/files may add to its file (boundaries, the
# purpose field).
UPLOAD_FORM_BYTES = 64 * 1024
MAX_PAGE = 100

Handler = Callable[[HttpRequest, ApiKey], Awaitable[HttpResponse]]


async def _api(request: HttpRequest, handlers: dict[str, Handler]) -> HttpResponse:
    """The pipeline's way in for resources; refusals framed by _refused."""
    return await keyed_request(request, handlers, refused=_refused)


def _json(body: bodies.Body) -> JsonResponse:
    return JsonResponse(body.model_dump(mode="json"))


def _refused(error: errors.ApiError) -> HttpResponse:
    response = error.response()
    if error.code in quotas.QUOTA_CODES:
        # Sending the same file again would not fit either (OpenAI's clients
        # retry a 429 unless told not to).
        response["x-should-retry"] = "false"
    return response


async def upload_refusal(
    *, authorization: str | None, client: str, declared: int
) -> HttpResponse | None:
    """The answer to an upload that its declared size already rules out,
    before its body is read (roundhouse.asgi): the key's refusal, or the
    storage quotas' (the refusals the view would give); None to read it."""
    try:
        key = await authenticate(authorization=authorization, client=client)
        await in_db_thread(quotas.room_check)(
            services.owner_filter(key), size=max(0, declared - UPLOAD_FORM_BYTES)
        )
    except Exception as error:
        return _refused(api_error(error, what="an upload's check"))
    return None


def _file_not_found(file_id: str) -> errors.ApiError:
    return errors.from_mapping(
        errors.NOT_FOUND,
        f"No such file: {file_id!r}.",
        code=errors.ApiCode.FILE_NOT_FOUND,
    )


def _batch_not_found(batch_id: str) -> errors.ApiError:
    return errors.from_mapping(
        errors.NOT_FOUND,
        f"No such batch: {batch_id!r}.",
        code=errors.ApiCode.BATCH_NOT_FOUND,
    )


# -- files -------------------------------------------------------------------------


def _store_upload(request: HttpRequest, key: ApiKey) -> StoredFile:
    """Parse the multipart body and store its file (in a thread: the parse and
    the copy are blocking work)."""
    upload = request.FILES.get("file")
    if upload is None:
        raise errors.invalid_request(
            "Send the file as multipart/form-data, in a field named 'file'.",
            param="file",
        )
    return services.file_store(
        key=key,
        chunks=upload.chunks(CHUNK_BYTES),
        filename=upload.name or "",
        purpose=request.POST.get("purpose", ""),
    )


async def _upload(request: HttpRequest, key: ApiKey) -> HttpResponse:
    stored = await in_db_thread(_store_upload)(request, key)
    return _json(selectors.file_body(stored))


async def _list_files(request: HttpRequest, key: ApiKey) -> HttpResponse:
    found = await in_db_thread(selectors.file_list)(
        key=key, purpose=request.GET.get("purpose")
    )
    data = [selectors.file_body(stored) for stored in found]
    return _json(bodies.FileList(data=data, has_more=False))


@csrf_exempt
async def files(request: HttpRequest) -> HttpResponse:
    """POST /v1/files (multipart: file, purpose=batch); GET /v1/files."""
    return await _api(request, {"POST": _upload, "GET": _list_files})


async def _stored(key: ApiKey, file_id: str) -> StoredFile:
    stored = await in_db_thread(selectors.file_get)(key=key, file_id=file_id)
    if stored is None:
        raise _file_not_found(file_id)
    return stored


@csrf_exempt
async def file(request: HttpRequest, file_id: str) -> HttpResponse:
    """GET and DELETE /v1/files/{file_id}."""

    async def get(request, key):
        return _json(selectors.file_body(await _stored(key, file_id)))

    async def delete(request, key):
        stored = await _stored(key, file_id)
        await in_db_thread(services.file_delete)(stored=stored)
        # The id asked for: a deleted row's own is None (Django clears it).
        return _json(bodies.FileDeleted(id=file_id))

    return await _api(request, {"GET": get, "DELETE": delete})


async def _chunks(path) -> AsyncIterator[bytes]:
    """A file's bytes, read in a thread a chunk at a time."""
    handle = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()


async def file_content(request: HttpRequest, file_id: str) -> HttpResponse:
    """GET /v1/files/{file_id}/content."""

    async def get(request, key):
        stored = await _stored(key, file_id)
        if not stored.path.exists():
            raise _file_not_found(file_id)
        response = StreamingHttpResponse(
            _chunks(stored.path), content_type="application/octet-stream"
        )
        response["Content-Length"] = str(stored.bytes)
        response["Content-Disposition"] = f'attachment; filename="{stored.id}.jsonl"'
        return response

    return await _api(request, {"GET": get})


# -- batches -------------------------------------------------------------------------


async def _create_batch(request: HttpRequest, key: ApiKey) -> HttpResponse:
    payload = parse(BatchRequest, request.body)
    batch = await in_db_thread(services.batch_create)(
        key=key,
        input_file_id=payload.input_file_id,
        endpoint=payload.endpoint,
        completion_window=payload.completion_window,
        metadata=payload.metadata,
    )
    return _json(selectors.batch_body(batch))


async def _list_batches(request: HttpRequest, key: ApiKey) -> HttpResponse:
    try:
        limit = int(request.GET.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise errors.invalid_request(
            f"limit must be a whole number from 1 to {MAX_PAGE}.", param="limit"
        )
    page, more = await in_db_thread(selectors.batch_page)(
        key=key, after=request.GET.get("after"), limit=limit
    )
    data = [selectors.batch_body(batch) for batch in page]
    return _json(
        bodies.BatchList(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=more,
        )
    )


@csrf_exempt
async def batches(request: HttpRequest) -> HttpResponse:
    """POST /v1/batches; GET /v1/batches (?limit=&after=)."""
    return await _api(request, {"POST": _create_batch, "GET": _list_batches})


async def _batch(key: ApiKey, batch_id: str) -> Batch:
    found = await in_db_thread(selectors.batch_get)(key=key, batch_id=batch_id)
    if found is None:
        raise _batch_not_found(batch_id)
    return found


@csrf_exempt
async def batch(request: HttpRequest, batch_id: str) -> HttpResponse:
    """GET /v1/batches/{batch_id}."""

    async def get(request, key):
        found = await _batch(key, batch_id)
        return _json(selectors.batch_body(found))

    return await _api(request, {"GET": get})


@csrf_exempt
async def batch_cancel(request: HttpRequest, batch_id: str) -> HttpResponse:
    """POST /v1/batches/{batch_id}/cancel."""

    async def post(request, key):
        found = await _batch(key, batch_id)
        cancelled = await in_db_thread(services.batch_cancel)(batch=found)
        return _json(selectors.batch_body(cancelled))

    return await _api(request, {"POST": post})
