"""Stored responses (api.models.StoredResponse): written, read and deleted
for their owner only, a key or a logged-in user; another's is as if it did
not exist. Each is kept ROUNDHOUSE_RESPONSES_RETENTION_DAYS from when it was
stored, by the database's clock: past that it reads as unknown at once, and
beat's pass (api.tasks.expire_stored_responses) deletes it. Synchronous: the
API runs these in its database thread (api.selectors.in_db_thread)."""

import json
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.db.models.fields.json import KT
from django.db.models.functions import Now

from ..models import ApiKey, StoredResponse

# The most a stored response may hold (its answer, input items and the
# conversation so far, as JSON): a request whose turn would be over it is
# refused before it runs (send store=false, or start a shorter chain).
MAX_STORED_BYTES = 8 * 1024 * 1024


def stored_size(*parts: Any) -> int:
    """The bytes these JSON values take, as stored."""
    return sum(len(json.dumps(part, separators=(",", ":"))) for part in parts)


# Expired responses are deleted this many to a statement: a pass over a large
# backlog never holds the table's write lock (SQLite has one writer) for long
# nor sends the database one huge delete.
EXPIRE_BATCH = 500


def _retention() -> timedelta | None:
    """How long a stored response is kept; None: until it is deleted."""
    days = settings.ROUNDHOUSE_RESPONSES_RETENTION_DAYS
    return timedelta(days=days) if days else None


def _kept() -> QuerySet[StoredResponse]:
    retention = _retention()
    if retention is None:
        return StoredResponse.objects.all()
    return StoredResponse.objects.filter(created_at__gt=Now() - retention)


def _owned(*, key: ApiKey | None, user: Any) -> QuerySet[StoredResponse]:
    if key is not None:
        return _kept().filter(key=key)
    if user is not None:
        return _kept().filter(user=user, key__isnull=True)
    return StoredResponse.objects.none()


def stored_response_get(
    *, key: ApiKey | None, user: Any = None, response_id: str
) -> StoredResponse | None:
    """The owner's stored response of this id, or None."""
    return _owned(key=key, user=user).filter(id=response_id).first()


def stored_response_save(
    *,
    key: ApiKey | None,
    user: Any = None,
    body: dict[str, Any],
    input_items: list[dict[str, Any]],
    conversation: list[dict[str, Any]],
) -> StoredResponse:
    """Store an answer for its owner (checked, then saved)."""
    stored = StoredResponse(
        id=body["id"],
        key=key,
        user=user if key is None else None,
        model=body["model"],
        body=body,
        input_items=input_items,
        conversation=conversation,
        size_bytes=stored_size(body, input_items, conversation),
    )
    stored.full_clean(validate_unique=False)
    stored.save(force_insert=True)
    return stored


def stored_response_delete(
    *, key: ApiKey | None, user: Any = None, response_id: str
) -> bool:
    """Delete the owner's stored response; whether there was one."""
    deleted, _ = _owned(key=key, user=user).filter(id=response_id).delete()
    return bool(deleted)


def stored_responses_expire(*, batch: int = EXPIRE_BATCH) -> int:
    """Delete every stored response past the retention, `batch` rows to a
    statement (each committed on its own); how many were deleted."""
    retention = _retention()
    if retention is None:
        return 0
    expired = StoredResponse.objects.filter(created_at__lte=Now() - retention)
    deleted = 0
    while True:
        ids = list(expired.order_by().values_list("pk", flat=True)[:batch])
        if not ids:
            return deleted
        _, per_model = StoredResponse.objects.filter(pk__in=ids).delete()
        deleted += per_model.get(StoredResponse._meta.label, 0)
        if len(ids) < batch:
            return deleted


def stored_responses_listed(
    queryset: QuerySet[StoredResponse],
) -> QuerySet[StoredResponse]:
    """These stored responses for a listing: each with its `status` (the
    answer's), without the answers, items and conversations themselves
    (megabytes each, and their owners' to read)."""
    return queryset.defer("body", "input_items", "conversation").annotate(
        status=KT("body__status")
    )


def stored_response_expires_at(stored: StoredResponse) -> datetime | None:
    """When this stored response expires; None: it is kept until deleted."""
    retention = _retention()
    return None if retention is None else stored.created_at + retention
