"""Reads of files and batches, and their bodies as the API answers them
(api.bodies)."""

from datetime import datetime
from typing import NamedTuple

from api import bodies
from api.errors import ApiCode
from api.models import ApiKey

from .models import Batch, StoredFile
from .services import owner_filter


def _seconds(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def file_get(*, key: ApiKey, file_id: str) -> StoredFile | None:
    """The key's file with this id (None: none, or another owner's)."""
    return StoredFile.objects.filter(owner_filter(key), pk=file_id).first()


def file_list(*, key: ApiKey, purpose: str | None = None) -> list[StoredFile]:
    files = StoredFile.objects.filter(owner_filter(key))
    if purpose:
        files = files.filter(purpose=purpose)
    return list(files[:10_000])


def file_body(stored: StoredFile) -> bodies.FileObject:
    """The file as the Files API answers it."""
    return bodies.FileObject(
        id=stored.id,
        bytes=stored.bytes,
        created_at=_seconds(stored.created_at),
        filename=stored.filename,
        purpose=stored.purpose,
    )


def batch_get(*, key: ApiKey, batch_id: str) -> Batch | None:
    """The key's batch with this id (None: none, or another owner's)."""
    return Batch.objects.filter(owner_filter(key), pk=batch_id).first()


def batch_page(
    *, key: ApiKey, after: str | None, limit: int
) -> tuple[list[Batch], bool]:
    """The key's batches, newest first, after the one with id `after`; and
    whether more follow."""
    batches = Batch.objects.filter(owner_filter(key)).order_by("-created_at", "-id")
    if after:
        anchor = batches.filter(pk=after).values_list("created_at", flat=True).first()
        if anchor is not None:
            batches = batches.filter(created_at__lt=anchor) | batches.filter(
                created_at=anchor, id__lt=after
            )
    page = list(batches[: limit + 1])
    return page[:limit], len(page) > limit


def batch_body(batch: Batch) -> bodies.Batch:
    """The batch as the Batch API answers it."""
    return bodies.Batch(
        id=batch.id,
        endpoint=batch.endpoint,
        errors={"data": batch.errors} if batch.errors else None,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=batch.status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=_seconds(batch.created_at),
        in_progress_at=_seconds(batch.in_progress_at),
        expires_at=_seconds(batch.expires_at),
        finalizing_at=_seconds(batch.finalizing_at),
        completed_at=_seconds(batch.completed_at),
        failed_at=_seconds(batch.failed_at),
        expired_at=_seconds(batch.expired_at),
        cancelling_at=_seconds(batch.cancelling_at),
        cancelled_at=_seconds(batch.cancelled_at),
        request_counts=bodies.BatchRequestCounts(
            total=batch.total, completed=batch.completed, failed=batch.failed
        ),
        metadata=batch.metadata or None,
    )


class RunState(NamedTuple):
    """What a running batch checks each time it records: why its key can no
    longer run it ("key_deleted" (or the batch is gone), "key_revoked"; ""
    while it can), and its expiry now."""

    key_state: str
    expires_at: datetime | None


def batch_run_state(*, batch_id: str) -> RunState:
    row = (
        Batch.objects.filter(pk=batch_id)
        .values_list("key_id", "key__revoked_at", "expires_at")
        .first()
    )
    if row is None or row[0] is None:
        return RunState(ApiCode.KEY_DELETED, row[2] if row else None)
    return RunState(ApiCode.KEY_REVOKED if row[1] is not None else "", row[2])
