"""Storage quotas of the Files API: what an owner's stored files (uploads,
and the output and error files of their batches) may take, what all stored
files may take, and the free space the files' disk keeps (the database and
the logs may live on it).

An upload is checked three times: from its declared size before its body is
read (roundhouse.asgi), against the room left while it is written (nothing
past it is kept), and once more, its owner locked, before its row is saved
(two uploads of one owner at once cannot both take the last room).

Refusals: 413 `quota_exceeded` for a file that alone is larger than an
owner's quota (it can never be stored); 429 `quota_exceeded` for one that
does not fit beside the owner's other files (deleting files makes room); 429
`storage_full` when all stored files, or the disk, are full. Neither 429 is
worth retrying as is: `x-should-retry: false` tells OpenAI's clients so
(batches.views)."""

import shutil
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Q, Sum

from api import errors

from .models import StoredFile

# Codes of the refusals (batches.views marks them not to be retried).
QUOTA_CODES = (errors.ApiCode.QUOTA_EXCEEDED, errors.ApiCode.STORAGE_FULL)


@dataclass(frozen=True)
class Room:
    """What an upload may still write: its owner's room, and the server's
    (all stored files' and the disk's), in bytes."""

    owner: int
    server: int

    @property
    def bytes(self) -> int:
        return max(0, min(self.owner, self.server))

    def refusal(self, size: int, *, so_far: bool = False) -> errors.ApiError:
        """Why a file of `size` bytes (`so_far`: at least, it went over while
        it was written) cannot be stored."""
        quota = settings.ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES
        described = f"The file ({size} bytes{' so far' if so_far else ''})"
        if size > quota:
            return errors.from_mapping(
                errors.TOO_LARGE,
                f"{described} is larger than the {quota} bytes an owner's "
                "stored files may take.",
                code=errors.ApiCode.QUOTA_EXCEEDED,
                param="file",
            )
        if self.owner <= self.server:
            return errors.rate_limited(
                f"{described} does not fit in the storage quota of this key's "
                f"owner ({quota} bytes; {max(0, self.owner)} left). Delete files "
                "(DELETE /v1/files/{file_id}) to make room.",
                1,
                code=errors.ApiCode.QUOTA_EXCEEDED,
            )
        return errors.rate_limited(
            f"{described} does not fit: the server's file storage is full "
            f"({max(0, self.server)} bytes left). Try again later, or ask the "
            "operator.",
            60,
            code=errors.ApiCode.STORAGE_FULL,
        )


def stored_bytes(owner: Q | None = None) -> int:
    """The bytes of the stored files an owner sees (`owner_filter`), or of
    all stored files."""
    files = (
        StoredFile.objects.all() if owner is None else StoredFile.objects.filter(owner)
    )
    return files.aggregate(used=Sum("bytes"))["used"] or 0


def room_left(owner: Q) -> Room:
    """The room an upload of this owner has now."""
    folder = settings.ROUNDHOUSE_FILES_DIR
    disk_room = (
        shutil.disk_usage(folder).free - settings.ROUNDHOUSE_FILES_MIN_FREE_BYTES
    )
    total_room = settings.ROUNDHOUSE_FILES_QUOTA_TOTAL_BYTES - stored_bytes()
    return Room(
        owner=settings.ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES - stored_bytes(owner),
        server=min(disk_room, total_room),
    )


def room_check(owner: Q, *, size: int) -> Room:
    """The room left, once a file of `size` bytes is known to fit in it
    (its refusal otherwise)."""
    room = room_left(owner)
    if size > room.bytes:
        raise room.refusal(size)
    return room
