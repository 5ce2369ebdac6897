"""Model files between nodes, over the node link (platform/node_link/protocol.py).

A node whose engines are placed a model it has no files for copies them from
another node, over the same authenticated (and pinned-TLS) link its front uses
for requests. A files stream is opened with FILES_STREAM as its target (never
an engine name: those have no colon). The caller sends one FileRequest frame;
the relay answers with one frame and closes the stream:

- `manifest`: the model's files (relative paths, sizes, SHA-256), or
- `range`: a RangeReply followed by exactly `length` raw bytes of one file.

Either may be an ErrorReply instead. A copy is made range by range (at most
MAX_RANGE bytes in memory), so its progress is known and an interrupted copy
resumes where it stopped. The relay answers through FileServer.reply, which
holds at most HELD_PER_LINK answers per link until the link takes them (drain)
and lets WAITING_PER_LINK more requests wait (the rest are refused), and the
copying side gives a peer MANIFEST_TIMEOUT_S for its manifest and
RANGE_TIMEOUT_S per range before it tries the next.

The relay serves only the files of a model its own catalog names (the path
the model has on that node), only to an authenticated node, and only the
files its manifest lists: the regular files under that path, a symbolic link
to a file counted as its target's content when the target lies inside the
model (or, for a Hugging Face cache snapshot, inside its models--* directory,
whose blobs the snapshot links to), and never a symbolically linked
directory. A range is served only for a path the manifest lists. The caller checks
every path it is sent (relative, no `..`), the free disk space before writing,
and each file's SHA-256 before the copy takes the model's place: a model's
files are whole or absent, never half there.
"""

import asyncio
import collections
import contextlib
import hashlib
import os
import stat
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.framing import decode_message, encode_message, read_frame
from engines.wire.replies import ErrorReply
from node_link.protocol import data_frames

FILES_STREAM = "files:"
MAX_RANGE = 8 << 20
IN_FLIGHT = 3  # ranges asked ahead while one is written
# What a relay holds for one link: ranges read and not yet taken by the link
# (written and drained), and requests waiting their turn; a request past that
# is answered `overloaded` at once.
HELD_PER_LINK = 2
WAITING_PER_LINK = 16
MAX_FILES = 4096
MAX_REQUEST_BYTES = 4096
MAX_MANIFEST_BYTES = 2 << 20
HASH_CHUNK = 4 << 20
# How long a copy waits for a peer's manifest, and for each range, before it
# gives up on that peer (the next is tried).
MANIFEST_TIMEOUT_S = 300.0
RANGE_TIMEOUT_S = 60.0
# Room the copy leaves on the disk it writes to.
DISK_MARGIN_BYTES = 256 << 20
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class FileRequest(BaseModel):
    """What a files stream asks: a model's manifest, or a range of one file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["manifest", "range"]
    model: str = Field(pattern=MODEL_NAME)
    path: str = Field(default="", max_length=1024)
    offset: int = Field(default=0, ge=0)
    length: int = Field(default=0, ge=0, le=MAX_RANGE)

    def encoded(self) -> bytes:
        return encode_message(self.model_dump(), max_bytes=MAX_REQUEST_BYTES)


class ManifestEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(max_length=1024)  # "" when the model is one file
    size: int = Field(ge=0)
    sha256: str = Field(pattern="^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Literal["ok"] = "ok"
    directory: bool  # the model's path is a directory (else one file)
    entries: list[ManifestEntry] = Field(max_length=MAX_FILES)

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.entries)


class RangeReply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Literal["ok"] = "ok"
    length: int = Field(ge=0, le=MAX_RANGE)


class CopyFailed(Exception):
    """A model's files could not be copied from this peer (why, in words)."""


def relative_part(path: str) -> PurePosixPath:
    """A manifest path as a safe relative path; ValueError for anything that
    could leave the model's directory."""
    relative = PurePosixPath(path)
    if (
        not path
        or "\\" in path
        or "\x00" in path
        or relative.is_absolute()
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise ValueError(f"not a relative path inside a model: {path!r}")
    return relative


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks. Blocking: run it in a thread."""
    return _file_digest(path).hexdigest()


def model_digests(path: Path) -> dict[str, str]:
    """The SHA-256 of each of a model's files, by the path its manifest lists
    it under ("" for a one-file model): what the catalog keeps to check copies
    against. Blocking: run it in a thread. FileNotFoundError without files."""
    _, listing = _listing(path)
    return {relative: file_sha256(real) for relative, real in listing.items()}


def _file_digest(path: Path):
    """A running SHA-256 of a file's bytes so far, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest


# -- the relay's side ------------------------------------------------------------

# A model of this node's catalog by name: its path here, or None.
ModelPath = Callable[[str], Awaitable[Path | None]]


class FileServer:
    """Answers files streams for a relay. Disk work runs in threads; hashes
    are kept while a file's size and modification time stay the same."""

    def __init__(self, model_path: ModelPath) -> None:
        self._model_path = model_path
        self._hashes: dict[tuple[str, int, int], str] = {}
        # Per link (its writer): the ranges it may hold, and how many wait.
        self._turns: weakref.WeakKeyDictionary[object, _Turns] = (
            weakref.WeakKeyDictionary()
        )

    async def reply(
        self, stream: int, request: bytes, link: asyncio.StreamWriter
    ) -> None:
        """Answer one files stream's request on `link` and wait until the link
        took it (drain): a link holds at most HELD_PER_LINK answers read and
        not yet taken, and WAITING_PER_LINK requests waiting for their turn
        (more are refused), so a peer that asks and does not read costs a
        bounded amount of memory."""
        turns = self._turns.get(link)
        if turns is None:
            turns = self._turns[link] = _Turns(asyncio.Semaphore(HELD_PER_LINK))
        if turns.waiting >= WAITING_PER_LINK:
            reply = _error(ErrorCode.OVERLOADED, "too many file requests on this link")
            link.write(data_frames(stream, reply))
            await link.drain()
            return
        turns.waiting += 1
        try:
            await turns.held.acquire()
        finally:
            turns.waiting -= 1
        try:
            turns.holding += 1
            reply = await self.answer(request)
            link.write(data_frames(stream, reply))
            del reply
            await link.drain()
        finally:
            turns.holding -= 1
            turns.held.release()

    async def answer(self, payload: bytes) -> bytes:
        """The encoded answer to one request frame's payload."""
        try:
            request = FileRequest.model_validate(decode_message(payload))
        except (ProtocolError, ValidationError):
            return _error(ErrorCode.BAD_REQUEST, "not a file request")
        root = await self._model_path(request.model)
        if root is None:
            return _error(ErrorCode.UNKNOWN_MODEL, f"no model {request.model!r} here")
        try:
            if request.kind == "manifest":
                manifest = await asyncio.to_thread(self._manifest, root)
                return encode_message(
                    manifest.model_dump(), max_bytes=MAX_MANIFEST_BYTES
                )
            data = await asyncio.to_thread(self._range, root, request)
        except FileNotFoundError:
            return _error(
                ErrorCode.UNKNOWN_MODEL, f"no files for model {request.model!r} here"
            )
        except (OSError, ValueError) as error:
            return _error(ErrorCode.BAD_REQUEST, str(error))
        return encode_message(RangeReply(length=len(data)).model_dump()) + data

    def _manifest(self, root: Path) -> Manifest:
        directory, listing = _listing(root)
        entries = [
            ManifestEntry(
                path=relative, size=real.stat().st_size, sha256=self._hash(real)
            )
            for relative, real in listing.items()
        ]
        return Manifest(directory=directory, entries=entries)

    def _range(self, root: Path, request: FileRequest) -> bytes:
        # Only a file the manifest lists, by the path it lists it under.
        _, listing = _listing(root)
        real = listing.get(request.path)
        if real is None:
            raise FileNotFoundError(f"{request.path!r} is not a file of this model")
        with open(real, "rb", opener=_no_follow) as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise FileNotFoundError(request.path)
            if request.offset + request.length > info.st_size:
                raise ValueError(
                    f"range {request.offset}+{request.length} is past the end "
                    f"({info.st_size} bytes)"
                )
            handle.seek(request.offset)
            return handle.read(request.length)

    def _hash(self, path: Path) -> str:
        info = os.stat(path)
        key = (str(path), info.st_size, info.st_mtime_ns)
        if key not in self._hashes:
            self._hashes[key] = file_sha256(path)
        return self._hashes[key]


@dataclass
class _Turns:
    held: asyncio.Semaphore
    waiting: int = 0
    holding: int = 0


def _listing(root: Path) -> tuple[bool, dict[str, Path]]:
    """A model's files as its manifest lists them: (whether the model is a
    directory, manifest path -> the regular file served for it). A file that
    is a symbolic link is served with its target's content when the target
    lies inside the model's bound (_bound), and left out otherwise; a
    symbolically linked directory is never followed. FileNotFoundError when
    the model has no files here."""
    try:
        real_root = Path(os.path.realpath(root, strict=True))
    except (OSError, RuntimeError):
        raise FileNotFoundError(root) from None
    bound = _bound(root)
    if real_root.is_file():
        if not real_root.is_relative_to(bound):
            raise FileNotFoundError(root)
        return False, {"": real_root}
    if not real_root.is_dir():
        raise FileNotFoundError(root)
    listing: dict[str, Path] = {}
    # The walk starts at the resolved root and descends only into real
    # directories (followlinks=False), so every directory is inside it.
    for directory, subdirs, files in os.walk(real_root, followlinks=False):
        subdirs.sort()
        for name in sorted(files):
            path = Path(directory) / name
            try:
                real = Path(os.path.realpath(path, strict=True))
            except (OSError, RuntimeError):
                continue  # a dangling or looping link
            if not real.is_relative_to(bound) or not stat.S_ISREG(
                os.stat(real).st_mode
            ):
                continue  # out of the model, or not a regular file
            if len(listing) == MAX_FILES:
                raise ValueError(f"more than {MAX_FILES} files")
            listing[path.relative_to(real_root).as_posix()] = real
    return True, listing


def _bound(root: Path) -> Path:
    """Where a model's symbolic links may point: inside the model's own
    (resolved) path, or, for a model in a Hugging Face cache snapshot
    (models--ORG--NAME/snapshots/REVISION[/FILE]), inside that repository's
    directory (its snapshots link to ../../blobs)."""
    absolute = Path(os.path.abspath(root))
    for place in (absolute, *absolute.parents):
        if place.parent.name == "snapshots" and place.parent.parent.name.startswith(
            "models--"
        ):
            return Path(os.path.realpath(place.parent.parent))
    return Path(os.path.realpath(root))


def _no_follow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW)


def _error(code: ErrorCode, message: str) -> bytes:
    return ErrorReply(code=code, message=message).encoded()


# -- the copying side ----------------------------------------------------------------

# Opens a files stream on a link with `data` sent: (reader, writer).
OpenStream = Callable[[bytes], Awaitable[tuple[asyncio.StreamReader, object]]]
# Told (bytes done, bytes in all) as the copy goes.
Progress = Callable[[int, int], None]


async def copy_model(
    open_stream: OpenStream,
    model: str,
    dest: Path,
    *,
    digests: Mapping[str, str],
    progress: Progress,
    manifest_timeout_s: float = MANIFEST_TIMEOUT_S,
    range_timeout_s: float = RANGE_TIMEOUT_S,
) -> None:
    """Copy `model`'s files to `dest` (which must not exist) from the node
    `open_stream` reaches. Resumes a copy left in `dest`'s staging place;
    CopyFailed when the peer cannot give them or they do not check out, or
    when its manifest takes over `manifest_timeout_s` or a range over
    `range_timeout_s` (a peer that answers pings but not the stream).

    `digests` are the catalog's SHA-256 of the model's files (model_digests):
    the peer must list exactly those files with those digests, and each file
    copied must hash to them; the peer's own word is never enough."""
    if not digests:
        raise CopyFailed("the catalog has no SHA-256 of this model's files yet")
    try:
        async with asyncio.timeout(manifest_timeout_s):
            manifest = await _ask_manifest(open_stream, model)
    except TimeoutError:
        raise CopyFailed(f"no manifest within {manifest_timeout_s:g} s") from None
    _check_against(manifest, digests)
    staging = dest.with_name(f".{dest.name}.copying")
    targets = _targets(manifest, staging)
    total = manifest.size
    have = await asyncio.to_thread(_staged_bytes, targets)
    free = await asyncio.to_thread(_free_bytes, dest.parent)
    if total - have + DISK_MARGIN_BYTES > free:
        raise CopyFailed(
            f"{total - have} bytes to copy, {free} free on {dest.parent} "
            f"(keeping {DISK_MARGIN_BYTES >> 20} MiB)"
        )
    done = have
    progress(done, total)
    for entry, target in targets:
        # What an earlier try left is hashed first, then every range as it is
        # written: the check at the end reads nothing again.
        digest, offset = await asyncio.to_thread(_staged_digest, target)
        ranges = _ranges(open_stream, model, entry, offset, range_timeout_s)
        with contextlib.closing(ranges):
            for asked in ranges:
                data = await asked
                await asyncio.to_thread(_append, target, data, digest)
                done += len(data)
                progress(done, total)
        if digest.hexdigest() != digests[entry.path]:
            await asyncio.to_thread(target.unlink)
            raise CopyFailed(f"{entry.path or dest.name}: SHA-256 does not match")
    await asyncio.to_thread(_take_place, staging, dest, manifest.directory)


def _check_against(manifest: Manifest, digests: Mapping[str, str]) -> None:
    """The peer's manifest names exactly the catalog's files, with the
    catalog's digests (else CopyFailed, before anything is asked)."""
    listed = {entry.path: entry.sha256 for entry in manifest.entries}
    if set(listed) != set(digests):
        extra = sorted(set(listed) - set(digests))[:3]
        lacking = sorted(set(digests) - set(listed))[:3]
        raise CopyFailed(
            f"the peer's files are not the catalog's (not in the catalog: "
            f"{extra}, missing: {lacking})"
        )
    for path, sha256 in listed.items():
        if sha256 != digests[path]:
            raise CopyFailed(f"{path or 'the file'}: not the catalog's SHA-256")


def _ranges(
    open_stream: OpenStream,
    model: str,
    entry: ManifestEntry,
    offset: int,
    timeout_s: float,
):
    """The ranges of one file from `offset`, as awaitables in order, with up
    to IN_FLIGHT asked ahead: the serving side reads the next while this one
    crosses the link and is written here (at most IN_FLIGHT * MAX_RANGE bytes
    held). Each range fails (CopyFailed) `timeout_s` after it is awaited."""
    asked: collections.deque[asyncio.Task] = collections.deque()
    try:
        while offset < entry.size or asked:
            while offset < entry.size and len(asked) < IN_FLIGHT:
                length = min(MAX_RANGE, entry.size - offset)
                request = FileRequest(
                    kind="range",
                    model=model,
                    path=entry.path,
                    offset=offset,
                    length=length,
                )
                task = asyncio.ensure_future(_ask_range(open_stream, request))
                # A range asked ahead of a failure is never awaited: its own
                # failure is not news.
                task.add_done_callback(_retrieved)
                asked.append(task)
                offset += length
            yield _within(asked.popleft(), timeout_s)
    finally:
        for task in asked:
            task.cancel()


async def _within(task: asyncio.Task, timeout_s: float) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            return await task
    except TimeoutError:
        raise CopyFailed(f"a range took over {timeout_s:g} s") from None


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _targets(manifest: Manifest, staging: Path) -> list[tuple[ManifestEntry, Path]]:
    if not manifest.directory:
        if len(manifest.entries) != 1 or manifest.entries[0].path:
            raise CopyFailed("a one-file model's manifest names other files")
        return [(manifest.entries[0], staging)]
    try:
        return [
            (entry, staging.joinpath(*relative_part(entry.path).parts))
            for entry in manifest.entries
        ]
    except ValueError as error:
        raise CopyFailed(str(error)) from None


async def _ask(open_stream: OpenStream, request: FileRequest, max_bytes: int):
    reader, writer = await open_stream(request.encoded())
    try:
        payload = await read_frame(reader, max_bytes=max_bytes)
        if payload is None:
            raise CopyFailed("the peer closed the stream")
        try:
            message = decode_message(payload)
        except ProtocolError as error:
            raise CopyFailed(error.message) from None
        if message.get("status") == "error":
            raise CopyFailed(ErrorReply.model_validate(message).message)
        return reader, writer, message
    except BaseException:
        writer.close()
        raise


async def _ask_manifest(open_stream: OpenStream, model: str) -> Manifest:
    request = FileRequest(kind="manifest", model=model)
    _, writer, message = await _ask(open_stream, request, MAX_MANIFEST_BYTES)
    writer.close()
    try:
        return Manifest.model_validate(message)
    except ValidationError as error:
        raise CopyFailed(f"not a manifest: {error}") from None


async def _ask_range(open_stream: OpenStream, request: FileRequest) -> bytes:
    reader, writer, message = await _ask(open_stream, request, MAX_REQUEST_BYTES)
    try:
        reply = RangeReply.model_validate(message)
        if reply.length != request.length:
            raise CopyFailed(f"asked {request.length} bytes, told {reply.length}")
        return await reader.readexactly(reply.length)
    except ValidationError as error:
        raise CopyFailed(f"not a range reply: {error}") from None
    except asyncio.IncompleteReadError:
        raise CopyFailed("the stream ended inside a range") from None
    finally:
        writer.close()


def _staged_bytes(targets: list[tuple[ManifestEntry, Path]]) -> int:
    """What an earlier copy left (a part longer than its file starts over)."""
    have = 0
    for entry, target in targets:
        size = _size_or_zero(target)
        if size > entry.size:
            target.unlink()
            size = 0
        have += size
    return have


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _free_bytes(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


def _staged_digest(path: Path):
    """A SHA-256 of what is staged at `path` (made empty if missing), and its
    size."""
    _append(path, b"", None)
    return _file_digest(path), path.stat().st_size


def _append(path: Path, data: bytes, digest) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as handle:
        handle.write(data)
    if digest is not None:
        digest.update(data)


def _take_place(staging: Path, dest: Path, directory: bool) -> None:
    """Move the checked copy to the model's path in one rename."""
    if directory:
        staging.mkdir(parents=True, exist_ok=True)  # a model of no files
    os.rename(staging, dest)
