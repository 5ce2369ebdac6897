"""Stored responses (api.models.StoredResponse): written, read and deleted
for their owner only, a key or a logged-in user; another's is as if it did
not exist. Synchronous: the API runs these in its database thread
(api.selectors.in_db_thread)."""

import json
from typing import Any

from ..models import ApiKey, StoredResponse

# The most a stored response may hold (its answer, input items and the
# conversation so far, as JSON): a request whose turn would be over it is
# refused before it runs (send store=false, or start a shorter chain).
MAX_STORED_BYTES = 8 * 1024 * 1024


def stored_size(*parts: Any) -> int:
    """The bytes these JSON values take, as stored."""
    return sum(len(json.dumps(part, separators=(",", ":"))) for part in parts)


def _owned(*, key: ApiKey | None, user: Any):
    if key is not None:
        return StoredResponse.objects.filter(key=key)
    if user is not None:
        return StoredResponse.objects.filter(user=user, key__isnull=True)
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
