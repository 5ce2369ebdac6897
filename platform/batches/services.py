"""Writes of files and batches: storing an upload (size-capped and within
the storage quotas while it is written: batches.quotas), creating and
cancelling a batch, a worker's claim on a batch (a lease it renews),
recording answered lines once each, writing the output and error files, and
resuming batches whose worker is gone (not those already queued; failing
those whose runs keep dying)."""

import json
import logging
import os
import secrets
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import current_app
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from api import errors
from api.models import ApiKey
from catalog.leases import lease_claim, owner_gone

from . import quotas
from .lines import count_lines
from .models import (
    OPEN_STATUSES,
    Batch,
    BatchEndpoint,
    BatchLine,
    BatchStatus,
    FilePurpose,
    StoredFile,
)

log = logging.getLogger("roundhouse.batches")

# OpenAI's caps: lines per batch; the one completion window.
MAX_BATCH_LINES = 50_000
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
# A worker's claim on a batch lasts this long unless renewed; it renews it
# every time it records lines (about every second while lines are answered).
LEASE_S = 30.0
# A batch sent to the broker is not sent again for this long while no worker
# has taken it (it waits behind other batches): only a message the broker
# lost is replaced, and the queue does not grow by every waiting batch each
# time beat resumes batches.
REQUEUE_AFTER_S = 900.0
# Runs that may die holding a batch, with no answer recorded in between,
# before it is failed instead of resumed (a batch that kills its worker, as
# an input that exhausts its memory did, would otherwise kill every worker
# that resumes it).
MAX_CRASHES = 3
# The Celery task that runs a batch (tasks.run_batch), queued by its name: the
# task module calls these services, never the other way round.
RUN_BATCH_TASK = "batches.run"


class LeaseLost(Exception):
    """Another worker took the batch over (this one was stopped too long)."""


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def owner_filter(key: ApiKey) -> Q:
    """What a key may see: its owner's files and batches (every key of that
    user), or, for a key with no owner, its own."""
    if key.owner_id is not None:
        return Q(key__owner_id=key.owner_id)
    return Q(key=key)


# -- files ------------------------------------------------------------------------


def file_store(
    *, key: ApiKey, chunks: Iterable[bytes], filename: str, purpose: str
) -> StoredFile:
    """Store an upload for the Batch API; a 400 for another purpose, an empty
    file or one of more than MAX_BATCH_LINES lines (split as the worker reads
    them: lines.input_lines), a 413 over ROUNDHOUSE_MAX_FILE_BYTES, and the
    storage quotas' refusals (batches.quotas). Sizes are counted as the file
    is written: nothing past the cap or the room left is kept."""
    if purpose != FilePurpose.BATCH:
        raise errors.invalid_request(
            f"The purpose {purpose!r} is not supported here; use 'batch'.",
            param="purpose",
        )
    cap = settings.ROUNDHOUSE_MAX_FILE_BYTES
    owner = owner_filter(key)
    room = quotas.room_left(owner)
    file_id = _new_id("file-")
    folder: Path = settings.ROUNDHOUSE_FILES_DIR
    partial = folder / f".{file_id}.partial"
    size = 0
    try:
        with open(partial, "xb") as handle:
            for chunk in chunks:
                size += len(chunk)
                if size > cap:
                    raise errors.too_large(None, cap)
                if size > room.bytes:
                    raise room.refusal(size, so_far=True)
                handle.write(chunk)
        with open(partial, "rb") as handle:
            lines = count_lines(handle)
        if size == 0 or lines == 0:
            raise errors.invalid_request("The file is empty.", param="file")
        if lines > MAX_BATCH_LINES:
            raise errors.invalid_request(
                f"The file has {lines} lines; a batch takes at most {MAX_BATCH_LINES}.",
                param="file",
            )
        with transaction.atomic():
            _owner_lock(key)
            quotas.room_check(owner, size=size)  # uploads of the owner meanwhile
            stored = StoredFile.objects.create(
                id=file_id,
                key=key,
                purpose=purpose,
                filename=(filename or "upload.jsonl")[:255],
                bytes=size,
            )
            os.replace(partial, folder / file_id)
    finally:
        partial.unlink(missing_ok=True)
    return stored


def _owner_lock(key: ApiKey) -> None:
    """Lock the owner of the key's files (its user, or the key) until the
    transaction ends: their quota is checked and taken one upload at a time."""
    if key.owner_id is not None:
        owners = get_user_model().objects.filter(pk=key.owner_id)
    else:
        owners = ApiKey.objects.filter(pk=key.pk)
    list(owners.select_for_update().values_list("pk", flat=True))


def file_delete(*, stored: StoredFile) -> None:
    """Delete a file and its bytes; a 400 while a batch reads it."""
    running = stored.batches.filter(status__in=OPEN_STATUSES).first()
    if running is not None:
        raise errors.invalid_request(
            f"The file is the input of batch {running.id}, which is still running.",
            param="file_id",
        )
    path = stored.path
    with transaction.atomic():
        Batch.objects.filter(input_file=stored).delete()
        stored.delete()
    path.unlink(missing_ok=True)


# -- batches -------------------------------------------------------------------------


def batch_create(
    *,
    key: ApiKey,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
) -> Batch:
    """Create a batch of an uploaded file and queue it for a worker (once the
    transaction commits). A batch needs a key: its lines are admitted in that
    key's batch budget, and a key's owner at its storage quota is refused
    (the batch's output would not fit)."""
    if key is None:
        raise errors.unauthorized("A batch needs an API key.")
    if endpoint not in BatchEndpoint.values:
        raise errors.invalid_request(
            f"The endpoint {endpoint!r} cannot be batched; use one of "
            f"{', '.join(BatchEndpoint.values)}.",
            param="endpoint",
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise errors.invalid_request(
            "The completion window must be '24h'.", param="completion_window"
        )
    stored = StoredFile.objects.filter(owner_filter(key), pk=input_file_id).first()
    if stored is None or stored.purpose != FilePurpose.BATCH:
        raise errors.from_mapping(
            errors.NOT_FOUND,
            f"No file with purpose 'batch' has the id {input_file_id!r}.",
            code=errors.ApiCode.FILE_NOT_FOUND,
            param="input_file_id",
        )
    quotas.room_check(owner_filter(key), size=1)  # room for its output
    now = timezone.now()
    batch = Batch.objects.create(
        id=_new_id("batch_"),
        key=key,
        endpoint=endpoint,
        input_file=stored,
        completion_window=completion_window,
        metadata=metadata or {},
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
    )
    batch_queue(batch.id)
    return batch


def batch_queue(batch_id: str) -> None:
    """Queue the batch's run once the current transaction commits, and stamp
    when (batches_resume does not send it again while it waits). A broker
    that cannot be reached is logged: the batch stays open, and a resume
    after REQUEUE_AFTER_S (a worker starting, beat's periodic run) queues it."""
    Batch.objects.filter(pk=batch_id).update(queued_at=Now())

    def send() -> None:
        try:
            current_app.send_task(RUN_BATCH_TASK, args=[batch_id])
        except Exception:
            log.exception("could not queue batch %s", batch_id)

    transaction.on_commit(send)


def batch_cancel(*, batch: Batch) -> Batch:
    """Ask for a batch to stop: its worker ends the lines in flight, writes the
    files with what was answered and marks it cancelled. A batch that has
    ended stays as it is (OpenAI answers it unchanged)."""
    now = timezone.now()
    changed = Batch.objects.filter(pk=batch.pk, status__in=OPEN_STATUSES).update(
        status=BatchStatus.CANCELLING, cancelling_at=now
    )
    if changed:
        batch_queue(batch.pk)  # nobody may be running it (not started yet)
    batch.refresh_from_db()
    return batch


# -- the worker's side ----------------------------------------------------------------


def batch_claim(*, batch_id: str, owner: str) -> bool:
    """Take the batch for this worker (True), unless another live worker
    holds it (catalog.leases.lease_claim)."""
    open_batch = Batch.objects.filter(pk=batch_id, status__in=OPEN_STATUSES)
    return lease_claim(open_batch, owner=owner, lease_s=LEASE_S)


def batch_start(*, batch: Batch, total: int) -> None:
    """The input file was read: `total` lines, now answered."""
    Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
        status=BatchStatus.IN_PROGRESS, total=total, in_progress_at=timezone.now()
    )
    batch.refresh_from_db()


def batch_record(
    *, batch_id: str, owner: str, answers: list[tuple[int, str, bool, dict]]
) -> str:
    """Record answered lines (index, custom_id, ok, record) and renew the
    lease; the batch's status now (a cancel shows here). A line already
    recorded keeps its first answer. LeaseLost when another worker holds the
    batch: nothing is recorded then."""
    with transaction.atomic():
        renewed = Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
            lease_until=Now() + timedelta(seconds=LEASE_S)
        )
        if not renewed:
            raise LeaseLost(batch_id)
        if answers:
            BatchLine.objects.bulk_create(
                [
                    BatchLine(
                        batch_id=batch_id,
                        index=index,
                        custom_id=custom_id[:512],
                        ok=ok,
                        record=record,
                    )
                    for index, custom_id, ok, record in answers
                ],
                ignore_conflicts=True,
            )
            lines = BatchLine.objects.filter(batch_id=batch_id)
            Batch.objects.filter(pk=batch_id).update(
                completed=lines.filter(ok=True).count(),
                failed=lines.filter(ok=False).count(),
                crashes=0,  # this run gets on: earlier deaths were not its doing
            )
        return Batch.objects.values_list("status", flat=True).get(pk=batch_id)


def _write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> int:
    """Write records as JSON lines, atomically (a reader never sees half a
    file); the file's size."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")
    os.replace(partial, path)
    return path.stat().st_size


def batch_finalize(
    *, batch_id: str, owner: str, final: str, why: dict[str, str] | None = None
) -> None:
    """Write the output and error files from the recorded lines and end the
    batch with status `final` (completed, cancelled, expired, failed: `why`
    then says why, a code and a message). Idempotent: a worker that dies
    here leaves the batch open, and the next one writes the same files
    (their ids come from the batch's) and ends it."""
    batch = Batch.objects.get(pk=batch_id)
    now = timezone.now()
    Batch.objects.filter(pk=batch_id, status=BatchStatus.IN_PROGRESS).update(
        status=BatchStatus.FINALIZING, finalizing_at=now
    )
    suffix = batch_id.removeprefix("batch_")
    files = {}
    for ok, name in ((True, "output"), (False, "errors")):
        lines = BatchLine.objects.filter(batch_id=batch_id, ok=ok).order_by("index")
        if not lines.exists():
            continue
        file_id = f"file-{suffix}-{name}"
        size = _write_jsonl(
            settings.ROUNDHOUSE_FILES_DIR / file_id,
            (line.record for line in lines.iterator(chunk_size=500)),
        )
        files[ok] = StoredFile(
            id=file_id,
            key_id=batch.key_id,
            purpose=FilePurpose.BATCH_OUTPUT,
            filename=f"{batch_id}_{name}.jsonl",
            bytes=size,
        )
    stamp = {
        BatchStatus.COMPLETED: "completed_at",
        BatchStatus.CANCELLED: "cancelled_at",
        BatchStatus.EXPIRED: "expired_at",
        BatchStatus.FAILED: "failed_at",
    }[final]
    with transaction.atomic():
        for stored in files.values():
            stored.save()  # an update where a run before this one saved it
        Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
            status=final,
            output_file=files.get(True),
            error_file=files.get(False),
            lease_owner="",
            lease_until=None,
            errors=[_batch_error(**why)] if why else batch.errors,
            **{stamp: now},
        )


def _batch_error(*, code: str, message: str) -> dict[str, Any]:
    """An entry of a batch's `errors.data`, as OpenAI shapes one."""
    return {"code": code, "message": message, "param": None, "line": None}


def batch_fail(*, batch_id: str, owner: str, code: str, message: str) -> None:
    """The whole batch failed before its lines could be answered (its input
    file is gone or unreadable, its key deleted, its runs kept dying)."""
    Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
        status=BatchStatus.FAILED,
        failed_at=timezone.now(),
        errors=[_batch_error(code=code, message=message)],
        lease_owner="",
        lease_until=None,
    )


CRASHED = (
    "The batch's worker died {crashes} times running it without answering "
    "a line; it is not run again."
)


def batches_resume() -> list[str]:
    """Queue every open batch that no live worker holds and that is not
    waiting in the broker already: its claim expired or its owner is a
    process of this host that is gone (a worker killed mid-batch: a crash,
    counted; a batch with MAX_CRASHES is failed instead), or it was never
    sent, or sent more than REQUEUE_AFTER_S ago and still not taken. The ids
    queued. Leases and queue stamps are judged by the database's clock."""
    queued = []
    rows = (
        Batch.objects.filter(status__in=OPEN_STATUSES)
        .annotate(db_now=Now())
        .values_list(
            "id", "lease_owner", "lease_until", "queued_at", "crashes", "db_now"
        )
    )
    for batch_id, owner, until, queued_at, crashes, now in rows:
        if owner:
            if until is not None and until >= now and not owner_gone(owner):
                continue  # a live worker holds it
            crashes += 1
            if crashes >= MAX_CRASHES:
                log.error("batch %s: its runs died %d times; failed", batch_id, crashes)
                Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
                    status=BatchStatus.FAILED,
                    failed_at=now,
                    errors=[
                        _batch_error(
                            code=errors.ApiCode.BATCH_CRASHED,
                            message=CRASHED.format(crashes=crashes),
                        )
                    ],
                    crashes=crashes,
                    lease_owner="",
                    lease_until=None,
                )
                continue
            Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
                lease_owner="", lease_until=None, crashes=crashes
            )
        elif queued_at is not None and now - queued_at < timedelta(
            seconds=REQUEUE_AFTER_S
        ):
            continue  # waiting for a worker in the broker
        batch_queue(batch_id)
        queued.append(batch_id)
    return queued
