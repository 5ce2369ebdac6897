"""Answering a batch in a Celery worker: its lines go to the engines through
the same routing and client as live requests (api.pipeline, api.answers),
several at once, marked as batch work so that the engines serve live requests
first. Answers are recorded about every second, once each
(services.batch_record); a worker that dies loses only the lines in flight,
which the next worker answers (services.batches_resume queues the batch
again), never one already recorded.

Lines the engines turn away for now (overloaded, cooling, no engine up) are
tried again with backoff until RETRY_FOR_S has passed; other failures go to
the error file as the API would have answered them."""

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from django import db
from django.conf import settings
from django.utils import timezone

from api import errors
from api.answers import embedding_answer, generation_answer
from api.calls import Call
from api.models import ApiKey
from api.pipeline import database_failed, model_route
from api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_object,
)
from api.selectors import in_db_thread

from . import services
from .lines import (
    MalformedLine,
    custom_id_of,
    error_record,
    failure_record,
    output_record,
    read_line,
)
from .models import Batch, BatchEndpoint, BatchLine, BatchStatus

log = logging.getLogger("roundhouse.batches")

# How often answered lines are recorded (and the lease renewed, and a cancel
# noticed), and how many at most wait for that.
RECORD_EVERY_S = 1.0
RECORD_MAX = 200
# Statuses worth trying again: the engine's queue is full (429), no engine is
# up or it is cooling or short of memory (503), it died or stopped answering
# mid-request (502, 504).
RETRY_STATUSES = {429, 502, 503, 504}
RETRY_FOR_S = 600.0
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)

SCHEMAS = {
    BatchEndpoint.CHAT_COMPLETIONS: ("chat.completions", ChatCompletionRequest),
    BatchEndpoint.COMPLETIONS: ("completions", CompletionRequest),
    BatchEndpoint.EMBEDDINGS: ("embeddings", EmbeddingRequest),
}

Answer = tuple[int, str, bool, dict[str, Any]]


def run_batch(batch_id: str) -> None:
    """Take the batch (unless a live worker holds it) and take it as far as
    it goes: read its file, answer its lines, write its files."""
    owner = services.worker_identity()
    if not services.batch_claim(batch_id=batch_id, owner=owner):
        log.info("batch %s: ended, or another worker holds it", batch_id)
        return
    batch = Batch.objects.select_related("input_file").get(pk=batch_id)
    try:
        raw_lines = batch.input_file.path.read_bytes().splitlines()
    except OSError as error:
        services.batch_fail(
            batch_id=batch_id,
            owner=owner,
            code="file_unreadable",
            message=f"The input file could not be read: {error.strerror or error}.",
        )
        return
    if batch.status == BatchStatus.VALIDATING:
        services.batch_start(batch=batch, total=len(raw_lines))
    final = BatchStatus.COMPLETED
    if batch.status == BatchStatus.IN_PROGRESS:
        done = set(
            BatchLine.objects.filter(batch_id=batch_id).values_list("index", flat=True)
        )
        todo = [(i, raw) for i, raw in enumerate(raw_lines) if i not in done]
        log.info(
            "batch %s: %d lines, %d answered before, %d to go",
            batch_id,
            len(raw_lines),
            len(done),
            len(todo),
        )
        key = batch.key
        if key is not None:
            # Read now: api_key_allows reads them from the key, and would query
            # the database from the event loop otherwise.
            key.allowed_model_names = frozenset(
                model.name for model in key.allowed_models.all()
            )
        run = BatchRun(batch, key, owner, todo)
        try:
            final = asyncio.run(run.answer())
        except services.LeaseLost:
            log.warning("batch %s: another worker took it over", batch_id)
            return
        finally:
            db.connections.close_all()  # this task thread's (the pool reuses it)
    elif batch.status == BatchStatus.CANCELLING:
        final = BatchStatus.CANCELLED
    services.batch_finalize(batch_id=batch_id, owner=owner, final=final)
    log.info("batch %s: %s", batch_id, final)


@dataclass
class BatchRun:
    """One worker's pass over a batch's remaining lines."""

    batch: Batch
    key: ApiKey | None
    owner: str
    todo: list[tuple[int, bytes]]
    answered: list[Answer] = field(default_factory=list)
    stopping: str = ""  # the final status once a cancel or the expiry stops it
    lost: bool = False  # another worker took the batch over
    # Set when RECORD_MAX answers wait: they are recorded without waiting
    # for the next RECORD_EVERY_S.
    many: asyncio.Event = field(default_factory=asyncio.Event)

    async def answer(self) -> str:
        """Answer every line, ROUNDHOUSE_BATCH_CONCURRENCY at once; the
        batch's final status."""
        lines = collections.deque(self.todo)
        workers = [
            asyncio.create_task(self._work(lines, self.key))
            for _ in range(max(1, settings.ROUNDHOUSE_BATCH_CONCURRENCY))
        ]
        record = asyncio.create_task(self._record_until(workers))
        try:
            await asyncio.gather(*workers)
        except asyncio.CancelledError:
            pass  # stopped by a cancel or the expiry (self.stopping)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            record.cancel()
            await asyncio.gather(record, return_exceptions=True)
        if self.lost:
            raise services.LeaseLost(self.batch.id)
        await self._record()  # what the last workers answered
        if self.stopping == BatchStatus.EXPIRED:
            await self._record_expired(lines)
        return self.stopping or BatchStatus.COMPLETED

    async def _work(self, lines: collections.deque, key: ApiKey | None) -> None:
        while lines and not self.stopping:
            index, raw = lines.popleft()
            answer = await self._line(index, raw, key)
            # Appended once answered: `self.answered` is swapped for a new list
            # each time answers are recorded.
            self.answered.append(answer)
            if len(self.answered) >= RECORD_MAX:
                self.many.set()

    async def _record_until(self, workers: list[asyncio.Task]) -> None:
        """Record answers every RECORD_EVERY_S (or RECORD_MAX answers); stop
        the workers on a cancel, the expiry, or a lost lease."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RECORD_EVERY_S):
                    await self.many.wait()
            self.many.clear()
            try:
                status = await self._record()
            except services.LeaseLost:
                self.lost = True
                status = ""
            if self.lost:
                self.stopping = BatchStatus.IN_PROGRESS
            elif status == BatchStatus.CANCELLING:
                self.stopping = BatchStatus.CANCELLED
            elif timezone.now() >= self.batch.expires_at:
                self.stopping = BatchStatus.EXPIRED
            if self.stopping:
                for worker in workers:
                    worker.cancel()  # a line in flight is cancelled in its engine
                return

    async def _record(self) -> str:
        answers, self.answered = self.answered, []
        try:
            return await in_db_thread(services.batch_record)(
                batch_id=self.batch.id, owner=self.owner, answers=answers
            )
        except db.Error:
            self.answered[:0] = answers  # kept for the next try
            log.exception("batch %s: recording answers failed", self.batch.id)
            return BatchStatus.IN_PROGRESS

    async def _record_expired(self, left: collections.deque) -> None:
        for index, raw in left:
            custom_id = custom_id_of(raw)
            self.answered.append(
                (
                    index,
                    custom_id,
                    False,
                    error_record(
                        custom_id,
                        "batch_expired",
                        "The batch expired before this request could be answered.",
                    ),
                )
            )
        await self._record()

    async def _line(self, index: int, raw: bytes, key: ApiKey | None) -> Answer:
        """One line's answer (never raises but for cancellation)."""
        endpoint, schema = SCHEMAS[self.batch.endpoint]
        try:
            line = read_line(
                raw,
                endpoint=self.batch.endpoint,
                max_bytes=settings.ROUNDHOUSE_MAX_REQUEST_BYTES,
            )
        except MalformedLine as bad:
            return (
                index,
                bad.custom_id,
                False,
                error_record(bad.custom_id, "invalid_request", bad.message),
            )
        started, attempt = time.monotonic(), 0
        while True:
            call = Call(endpoint, key=key)
            try:
                payload = parse_object(schema, line.body)
                if getattr(payload, "stream", False):
                    raise errors.invalid_request(
                        "A batch line cannot be streamed.", param="stream"
                    )
                body = await self._ask(call, payload)
            except errors.ApiError as error:
                failure = error
            except db.Error as error:
                failure = database_failed(error)
            except Exception:
                log.exception("batch %s: line %d failed", self.batch.id, index)
                failure = errors.engine_error("internal", "Internal error.")
            else:
                await call.end()
                return index, line.custom_id, True, output_record(line.custom_id, body)
            call.failed(failure)
            await call.end()
            waited = time.monotonic() - started
            if failure.status not in RETRY_STATUSES or waited > RETRY_FOR_S:
                return (
                    index,
                    line.custom_id,
                    False,
                    failure_record(line.custom_id, failure.status, failure.body()),
                )
            await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
            attempt += 1

    async def _ask(self, call: Call, payload: Any) -> dict[str, Any]:
        route, snapshot = await model_route(call, payload.model)
        if isinstance(payload, EmbeddingRequest):
            return await embedding_answer(call, payload, route, snapshot)
        chat = isinstance(payload, ChatCompletionRequest)
        body, _ = await generation_answer(
            call, payload, route, snapshot, chat=chat, priority="batch"
        )
        return body
