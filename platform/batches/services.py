"""Writes of files and batches: storing an upload (size-capped while it is
written), creating and cancelling a batch, a worker's claim on a batch (a
lease it renews), recording answered lines once each, writing the output and
error files, and resuming batches whose worker is gone."""

import json
import logging
import os
import secrets
import socket
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from api import errors
from api.models import ApiKey

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
    file or one of more than MAX_BATCH_LINES lines, a 413 over
    ROUNDHOUSE_MAX_FILE_BYTES (counted as it is written: nothing past the cap
    is kept)."""
    if purpose != FilePurpose.BATCH:
        raise errors.invalid_request(
            f"The purpose {purpose!r} is not supported here; use 'batch'.",
            param="purpose",
        )
    cap = settings.ROUNDHOUSE_MAX_FILE_BYTES
    file_id = _new_id("file-")
    folder: Path = settings.ROUNDHOUSE_FILES_DIR
    partial = folder / f".{file_id}.partial"
    size = lines = 0
    last = b"\n"
    try:
        with open(partial, "xb") as handle:
            for chunk in chunks:
                size += len(chunk)
                if size > cap:
                    raise errors.too_large(None, cap)
                lines += chunk.count(b"\n")
                last = chunk[-1:] or last
                handle.write(chunk)
        lines += last != b"\n"  # a last line without its newline
        if size == 0 or lines == 0:
            raise errors.invalid_request("The file is empty.", param="file")
        if lines > MAX_BATCH_LINES:
            raise errors.invalid_request(
                f"The file has {lines} lines; a batch takes at most {MAX_BATCH_LINES}.",
                param="file",
            )
        os.replace(partial, folder / file_id)
    finally:
        partial.unlink(missing_ok=True)
    return StoredFile.objects.create(
        id=file_id,
        key=key,
        purpose=purpose,
        filename=(filename or "upload.jsonl")[:255],
        bytes=size,
    )


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
    transaction commits)."""
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
            code="file_not_found",
            param="input_file_id",
        )
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
    """Queue the batch's run once the current transaction commits. A broker
    that cannot be reached is logged: the batch stays open, and the next
    resume (a worker starting, beat's periodic run) queues it."""

    def send() -> None:
        from .tasks import run_batch  # the task module imports these services

        try:
            run_batch.delay(batch_id)
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


def worker_identity() -> str:
    """A run of a batch in this process, as a lease owner: host, pid, the
    process's start time (a pid reused by a later process is not taken for
    this one) and a token of the run (a worker runs tasks in threads: two
    runs of one batch in one process are two owners)."""
    started = int(psutil.Process().create_time())
    return f"{socket.gethostname()}:{os.getpid()}:{started}:{secrets.token_hex(4)}"


def owner_gone(owner: str) -> bool:
    """Whether a lease owner is a process of this host that is no longer
    running (one on another host is judged by its lease's expiry alone)."""
    try:
        host, pid, started, _ = owner.split(":")
        pid_number, started_at = int(pid), int(started)
    except ValueError:
        return True
    if host != socket.gethostname():
        return False
    try:
        return int(psutil.Process(pid_number).create_time()) != started_at
    except psutil.NoSuchProcess:
        return True


def batch_claim(*, batch_id: str, owner: str) -> bool:
    """Take the batch for this worker (True), unless another live worker
    holds it. Atomic: of two workers that try at once, one gets it."""
    now = timezone.now()
    return bool(
        Batch.objects.filter(pk=batch_id, status__in=OPEN_STATUSES)
        .filter(
            Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_owner=owner)
        )
        .update(lease_owner=owner, lease_until=now + timedelta(seconds=LEASE_S))
    )


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
    now = timezone.now()
    with transaction.atomic():
        renewed = Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
            lease_until=now + timedelta(seconds=LEASE_S)
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


def batch_finalize(*, batch_id: str, owner: str, final: str) -> None:
    """Write the output and error files from the recorded lines and end the
    batch with status `final` (completed, cancelled, expired). Idempotent: a
    worker that dies here leaves the batch open, and the next one writes the
    same files (their ids come from the batch's) and ends it."""
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
            **{stamp: now},
        )


def batch_fail(*, batch_id: str, owner: str, code: str, message: str) -> None:
    """The whole batch failed (its input file is gone or unreadable)."""
    Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
        status=BatchStatus.FAILED,
        failed_at=timezone.now(),
        errors=[{"code": code, "message": message, "param": None, "line": None}],
        lease_owner="",
        lease_until=None,
    )


def batch_release(*, batch_id: str, owner: str) -> None:
    """Give up the claim (the worker is stopping with lines left)."""
    Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
        lease_owner="", lease_until=None
    )


def batches_resume() -> list[str]:
    """Queue every open batch that no live worker holds: its claim expired,
    was never taken, or its owner is a process of this host that is gone (a
    worker killed mid-batch). The ids queued."""
    now = timezone.now()
    queued = []
    for batch_id, owner, until in Batch.objects.filter(
        status__in=OPEN_STATUSES
    ).values_list("id", "lease_owner", "lease_until"):
        if owner and until is not None and until >= now and not owner_gone(owner):
            continue
        if owner:
            Batch.objects.filter(pk=batch_id, lease_owner=owner).update(
                lease_owner="", lease_until=None
            )
        batch_queue(batch_id)
        queued.append(batch_id)
    return queued
