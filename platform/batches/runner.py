"""Answering a batch in a Celery worker: its lines go to the engines through
the same pipeline as live requests (api.pipeline: the key's model list, its
admission, routing; api.answers), several at once, marked as batch work so
that the engines serve live requests first. Answers are recorded about every
second, once each (services.batch_record); a worker that dies loses only the
lines in flight, which the next worker answers (services.batches_resume
queues the batch again), never one already recorded.

The input file is read a line at a time (batches.line_feed.LineFeed), never held
whole. Each line is admitted in its key's batch budget (the key's rate and
concurrency limits, counted apart from its live requests:
api.limits.Allowance.of_key_batches); a run keeps no more lines in flight
than the key's max_concurrent allows, and a line the budget refuses for now
(429) waits for its Retry-After and is tried again, nothing sent. Lines the
engines turn away for now (overloaded, cooling, no engine up) are tried again
with backoff until ROUNDHOUSE_BATCH_RETRY_S has passed; other failures go to
the error file as the API would have answered them. A line that was admitted
ends in one usage row (its last try's outcome; 499 when the batch stopped
while it was in flight), however often it was tried.

A run stops at a cancel (cancelled: the lines answered so far), at the
expiry (expired), or when its key is revoked or deleted (failed, with the
code in the batch's errors): then the lines in flight and those not started
go to the error file with the reason's code, so that every line ends in
exactly one of the two files."""

import asyncio
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
from api.pipeline import api_error, call_admitted
from api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_object,
)
from api.selectors import in_db_thread
from catalog.leases import worker_identity

from . import selectors, services
from .line_feed import Capacity, LineFeed
from .lines import (
    MalformedLine,
    Oversized,
    count_lines,
    custom_id_of,
    error_record,
    failure_record,
    output_record,
    read_line,
)
from .models import Batch, BatchEndpoint, BatchLine, BatchStatus

log = logging.getLogger("roundhouse.batches")

# How often answered lines are recorded (and the lease renewed, and a cancel,
# a revoked key or the expiry noticed), and how many at most wait for that.
RECORD_EVERY_S = 1.0
RECORD_MAX = 200
# Statuses worth trying again: the engine's queue is full (429), no engine is
# up or it is cooling or short of memory (503), it stopped answering (504) or
# answered something unreadable (502). Never a line whose engine died while
# serving it (NOT_RETRIED): the line may be what killed it, and trying it
# again would take down one engine after another; that line fails alone.
RETRY_STATUSES = {429, 502, 503, 504}
NOT_RETRIED = frozenset({errors.ApiCode.ENGINE_DIED})
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)

SCHEMAS = {
    BatchEndpoint.CHAT_COMPLETIONS: ("chat.completions", ChatCompletionRequest),
    BatchEndpoint.COMPLETIONS: ("completions", CompletionRequest),
    BatchEndpoint.EMBEDDINGS: ("embeddings", EmbeddingRequest),
}

# Why a run stopped before every line was answered: the code and message of
# the lines left (in flight, or not started) in the error file.
EXPIRED = (
    errors.ApiCode.BATCH_EXPIRED,
    "The batch expired before this request could be answered.",
)
KEY_STOPS = {
    errors.ApiCode.KEY_REVOKED: (
        "The batch's API key was revoked; its requests are not run."
    ),
    errors.ApiCode.KEY_DELETED: (
        "The batch's API key was deleted; its requests are not run."
    ),
}

Answer = tuple[int, str, bool, dict[str, Any]]


def run_batch(batch_id: str) -> None:
    """Take the batch (unless a live worker holds it) and take it as far as
    it goes: read its file, answer its lines, write its files. A run that
    fails (but for the database: the batch is resumed once it is back) fails
    the batch with its reason, rather than leaving it to be resumed into the
    same failure."""
    owner = worker_identity()
    if not services.batch_claim(batch_id=batch_id, owner=owner):
        log.info("batch %s: ended, or another worker holds it", batch_id)
        return
    try:
        _run(batch_id, owner)
    except services.LeaseLost:
        log.warning("batch %s: another worker took it over", batch_id)
    except db.Error:
        raise
    except Exception as error:
        log.exception("batch %s: the run failed", batch_id)
        services.batch_fail(
            batch_id=batch_id,
            owner=owner,
            code=errors.ApiCode.BATCH_RUN_FAILED,
            message=f"The batch could not be run ({type(error).__name__}).",
        )


def _run(batch_id: str, owner: str) -> None:
    batch = Batch.objects.select_related("input_file", "key").get(pk=batch_id)
    if batch.crashes >= services.MAX_CRASHES:
        services.batch_fail(
            batch_id=batch_id,
            owner=owner,
            code=errors.ApiCode.BATCH_CRASHED,
            message=services.CRASHED.format(crashes=batch.crashes),
        )
        return
    key = batch.key
    if key is None:
        services.batch_fail(
            batch_id=batch_id,
            owner=owner,
            code=errors.ApiCode.KEY_DELETED,
            message=KEY_STOPS[errors.ApiCode.KEY_DELETED],
        )
        return
    try:
        handle = open(batch.input_file.path, "rb")  # noqa: SIM115 (closed below)
    except OSError as error:
        services.batch_fail(
            batch_id=batch_id,
            owner=owner,
            code=errors.ApiCode.FILE_UNREADABLE,
            message=f"The input file could not be read: {error.strerror or error}.",
        )
        return
    final, why = BatchStatus.COMPLETED, None
    with handle:
        if batch.status == BatchStatus.VALIDATING:
            total = count_lines(handle)
            handle.seek(0)
            services.batch_start(batch=batch, total=total)
        if batch.status == BatchStatus.IN_PROGRESS:
            done = set(
                BatchLine.objects.filter(batch_id=batch_id).values_list(
                    "index", flat=True
                )
            )
            log.info(
                "batch %s: %d lines, %d answered before",
                batch_id,
                batch.total,
                len(done),
            )
            # Read now: api_key_allows reads them from the key, and would query
            # the database from the event loop otherwise.
            key.allowed_model_names = frozenset(
                model.name for model in key.allowed_models.all()
            )
            feed = LineFeed(
                handle, skip=done, max_bytes=settings.ROUNDHOUSE_MAX_REQUEST_BYTES
            )
            run = BatchRun(batch, key, owner, feed)
            try:
                final = asyncio.run(run.answer())
            finally:
                db.connections.close_all()  # this task thread's (the pool reuses it)
            why = run.why
        elif batch.status == BatchStatus.CANCELLING:
            final = BatchStatus.CANCELLED
    services.batch_finalize(batch_id=batch_id, owner=owner, final=final, why=why)
    log.info("batch %s: %s", batch_id, final)


def _record_and_check(
    *, batch_id: str, owner: str, answers: list[Answer]
) -> tuple[str, selectors.RunState]:
    """Record answers; the batch's status, its key's state and its expiry now."""
    status = services.batch_record(batch_id=batch_id, owner=owner, answers=answers)
    return status, selectors.batch_run_state(batch_id=batch_id)


@dataclass
class BatchRun:
    """One worker's pass over a batch's remaining lines."""

    batch: Batch
    key: ApiKey
    owner: str
    feed: LineFeed
    answered: list[Answer] = field(default_factory=list)
    stopping: str = ""  # the final status once a cancel, the expiry or the key stops it
    # The code and message of the lines left when it stopped ("": they are
    # left out, as a cancel leaves them).
    left: tuple[str, str] = ("", "")
    # A failed batch's reason (its `errors`).
    why: dict[str, str] | None = None
    lost: bool = False  # another worker took the batch over
    # Set when RECORD_MAX answers wait: they are recorded without waiting
    # for the next RECORD_EVERY_S.
    many: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.capacity = Capacity(self.key.max_concurrent or None)

    async def answer(self) -> str:
        """Answer every line, ROUNDHOUSE_BATCH_CONCURRENCY at once (or the
        key's max_concurrent, if fewer); the batch's final status."""
        state = await in_db_thread(selectors.batch_run_state)(batch_id=self.batch.id)
        if state.key_state:
            self._stop_for_key(state.key_state)
        at_once = max(1, settings.ROUNDHOUSE_BATCH_CONCURRENCY)
        if self.key.max_concurrent:
            at_once = min(at_once, self.key.max_concurrent)
        workers = [
            asyncio.create_task(self._work())
            for _ in range(0 if self.stopping else at_once)
        ]
        record = asyncio.create_task(self._record_until(workers))
        try:
            await asyncio.gather(*workers)
        except asyncio.CancelledError:
            pass  # stopped by a cancel, the expiry or the key (self.stopping)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            record.cancel()
            await asyncio.gather(record, return_exceptions=True)
        if self.lost:
            raise services.LeaseLost(self.batch.id)
        await self._record()  # what the last workers answered
        if self.left[0]:
            await self._record_left()
        return self.stopping or BatchStatus.COMPLETED

    def _stop_for_key(self, state: str) -> None:
        self.stopping = BatchStatus.FAILED
        self.left = (state, KEY_STOPS[state])
        self.why = {"code": state, "message": KEY_STOPS[state]}

    async def _work(self) -> None:
        while not self.stopping:
            item = await self.feed.next()
            if item is None:
                return
            index, raw = item
            try:
                answer = await self._line(index, raw)
            except asyncio.CancelledError:
                if self.left[0]:  # in flight when the batch stopped
                    self.answered.append(self._left_answer(index, raw))
                raise
            # Appended once answered: `self.answered` is swapped for a new list
            # each time answers are recorded.
            self.answered.append(answer)
            if len(self.answered) >= RECORD_MAX:
                self.many.set()

    async def _record_until(self, workers: list[asyncio.Task]) -> None:
        """Record answers every RECORD_EVERY_S (or RECORD_MAX answers); stop
        the workers on a cancel, a revoked or deleted key, the expiry, or a
        lost lease."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RECORD_EVERY_S):
                    await self.many.wait()
            self.many.clear()
            try:
                status, state = await self._record(check=True)
            except services.LeaseLost:
                self.lost = True
                status, state = "", None
            if state is not None and state.expires_at is not None:
                self.batch.expires_at = state.expires_at  # as the database has it
            if self.lost:
                self.stopping = BatchStatus.IN_PROGRESS
            elif status == BatchStatus.CANCELLING:
                self.stopping = BatchStatus.CANCELLED
            elif state is not None and state.key_state:
                self._stop_for_key(state.key_state)
            elif timezone.now() >= self.batch.expires_at:
                self.stopping = BatchStatus.EXPIRED
                self.left = EXPIRED
            if self.stopping:
                for worker in workers:
                    worker.cancel()  # a line in flight is cancelled in its engine
                return

    async def _record(
        self, *, check: bool = False
    ) -> tuple[str, selectors.RunState | None]:
        """Record the answers waiting; the batch's status, and with `check`
        its run state (else None)."""
        answers, self.answered = self.answered, []
        record = _record_and_check if check else services.batch_record
        try:
            result = await in_db_thread(record)(
                batch_id=self.batch.id, owner=self.owner, answers=answers
            )
        except db.Error:
            self.answered[:0] = answers  # kept for the next try
            log.exception("batch %s: recording answers failed", self.batch.id)
            return BatchStatus.IN_PROGRESS, None
        return result if check else (result, None)

    def _left_answer(self, index: int, raw: bytes | Oversized) -> Answer:
        custom_id = custom_id_of(raw)
        code, message = self.left
        return index, custom_id, False, error_record(custom_id, code, message)

    async def _record_left(self) -> None:
        """File every line not started as left (a few hundred at a time)."""
        while (item := await self.feed.next()) is not None:
            self.answered.append(self._left_answer(*item))
            if len(self.answered) >= RECORD_MAX:
                await self._record()
        await self._record()

    async def _line(self, index: int, raw: bytes | Oversized) -> Answer:
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
                error_record(
                    bad.custom_id, errors.ApiCode.INVALID_REQUEST, bad.message
                ),
            )
        started, attempt = time.monotonic(), 0
        # The line's last try that was admitted: its usage row is the line's.
        admitted: Call | None = None
        try:
            while True:
                call = Call(endpoint, key=self.key, batch=True)
                wait_s = None
                try:
                    payload = parse_object(schema, line.body)
                    if getattr(payload, "stream", False):
                        raise errors.invalid_request(
                            "A batch line cannot be streamed.", param="stream"
                        )
                    async with self.capacity.hold(payload.weight):
                        try:
                            wait_s = await self._admitted(call, payload)
                            if wait_s is None:
                                admitted = call
                                body = await self._ask(call, payload)
                        finally:
                            await call.held.aclose()  # the key's slot, in this hold
                except Exception as error:
                    failure = api_error(
                        error, what=f"batch {self.batch.id}: line {index}"
                    )
                else:
                    if wait_s is not None:  # the batch budget is spent for now
                        await asyncio.sleep(wait_s)
                        continue
                    await call.end()
                    return (
                        index,
                        line.custom_id,
                        True,
                        output_record(line.custom_id, body),
                    )
                waited = time.monotonic() - started
                if (
                    failure.status not in RETRY_STATUSES
                    or failure.code in NOT_RETRIED
                    or waited > settings.ROUNDHOUSE_BATCH_RETRY_S
                ):
                    if admitted is not None:
                        admitted.failed(failure)
                        await admitted.end()
                    return (
                        index,
                        line.custom_id,
                        False,
                        failure_record(line.custom_id, failure.status, failure.body()),
                    )
                await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
                attempt += 1
        except asyncio.CancelledError:
            if admitted is not None and not admitted.ended:
                # Stopped in flight (or between its tries): its usage row says so.
                admitted.status = 499
                admitted.error_code = self.left[0] or errors.ApiCode.BATCH_CANCELLED
                await asyncio.shield(admitted.end())
            raise

    async def _admitted(self, call: Call, payload: Any) -> float | None:
        """The line's call routed and admitted in its key's batch budget (the
        pipeline's way in): None once admitted, or the seconds to wait when
        the budget is spent for now (a 429: nothing was counted against the
        line, nothing sent)."""
        try:
            await call_admitted(call, payload.model, weight=payload.weight)
        except errors.ApiError as refused:
            if refused.status != 429:
                raise  # too heavy for the key's whole concurrency: a 400
            return float(refused.retry_after_s or 1)
        return None

    async def _ask(self, call: Call, payload: Any) -> dict[str, Any]:
        if isinstance(payload, EmbeddingRequest):
            return await embedding_answer(call, payload)
        chat = isinstance(payload, ChatCompletionRequest)
        body, _ = await generation_answer(call, payload, chat=chat, priority="batch")
        return body
