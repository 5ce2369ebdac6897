"""A model's file from the Hub onto this host, whole or not at all.

`pull_file` downloads through huggingface_hub's own pieces (the file's URL at
the repository's pinned commit, its metadata, and `http_get`, which continues a
file from a byte with a range request) into a partial file in a staging folder
inside the models directory. The partial file is kept when the download stops
(a cut connection, a killed worker, a restarted host) and the next pull
continues it: `hf_hub_download` would not, as it deletes what it had. Then the
SHA-256 the Hub publishes is checked (the client checks sizes only), and only
then the file moves to its place with one rename. Before it starts, the disk
must hold the file and keep DISK_MARGIN_BYTES free; a file already in its place
with the Hub's SHA-256 is not downloaded again (a small file, which the Hub
publishes none for, is: it costs nothing). A file at a plain address (an
https:// source, pull_url.py) comes the same way, checked against the SHA-256
its pull was given."""

import errno
import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import transaction
from huggingface_hub.file_download import http_get
from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

from .hub import (
    HubError,
    HubFile,
    HubRepo,
    gguf_facts,
    hub_download_location,
    hub_errors,
    hub_repo,
)
from .hub_folders import folder_facts
from .models import ModelConfig, ModelFormat
from .pull_url import (
    is_url,
    url_checked,
    url_errors,
    url_facts,
    url_file,
    url_folder,
    url_name,
)
from .services import model_inspection_queue

# What a download leaves free on the models' disk, at the least.
DISK_MARGIN_BYTES = 1 << 30
# Where downloads in progress are kept, inside the models directory (the same
# filesystem: the finished file takes its place with one rename).
STAGING = ".pulls"
# A download in progress: the file's name with this suffix, in STAGING.
PARTIAL = ".partial"
GIB = 1 << 30
# A download looks at the free disk again this often.
DISK_CHECK_EVERY_S = 1.0


@dataclass(frozen=True)
class Progress:
    """A download's bytes so far, its size, and its rate since it started."""

    done: int
    size: int
    elapsed_s: float

    @property
    def rate(self) -> float:
        """Bytes per second."""
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def left_s(self) -> float | None:
        """Seconds left at this rate (None before there is a rate)."""
        return (self.size - self.done) / self.rate if self.rate else None


def model_folder(models_dir: Path, repo_id: str) -> Path:
    """Where a repository's files are kept: `org--name` in the models dir."""
    return Path(models_dir) / repo_id.replace("/", "--")


def pull_file(
    repo: HubRepo,
    file: HubFile,
    models_dir: Path,
    *,
    progress: Callable[[Progress], None] | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    margin_bytes: int = DISK_MARGIN_BYTES,
    url: str = "",
) -> Path:
    """The file in its place (model_folder / its name), downloaded if it is
    not there yet; HubError when the Hub refuses, the disk has no room
    (507) or what came is not what the Hub published (502: removed). With
    `url`, the file comes from that address (no token sent), not the Hub."""
    dest = model_folder(models_dir, repo.repo_id) / file.name
    if dest.is_file() and file.sha256 and _matches(dest, file):
        return dest
    staging = model_folder(Path(models_dir) / STAGING, repo.repo_id)
    fetched = staging / (file.name + PARTIAL)
    fetched.parent.mkdir(parents=True, exist_ok=True)
    if fetched.exists() and fetched.stat().st_size > file.size:
        fetched.unlink()  # not a start of this file: start over
    done = fetched.stat().st_size if fetched.exists() else 0
    _room_for(file, fetched.parent, file.size - done, margin_bytes)
    errors = url_errors(url) if url else hub_errors(repo.repo_id, repo.commit)
    with errors:
        location, headers = url, {}
        if not url:
            location, headers = hub_download_location(
                repo, file, endpoint=endpoint, token=token
            )
        try:
            with open(fetched, "ab") as out, _Hashing(out, fetched) as hashed:
                if done < file.size:
                    http_get(
                        location,
                        hashed,
                        resume_size=done,
                        headers=headers,
                        expected_size=file.size,
                        displayed_filename=file.name,
                        tqdm_class=_reporting(
                            progress, file.size, fetched.parent, margin_bytes
                        ),
                    )
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            fetched.unlink(missing_ok=True)  # give the disk back to the rest
            raise HubError(
                507,
                f"{file.name}: the disk filled up during the download "
                f"({fetched.parent}); the partial file was removed: free room, "
                "then pull again",
            ) from None
    if fetched.stat().st_size != file.size or (
        file.sha256 and hashed.hexdigest() != file.sha256
    ):
        fetched.unlink(missing_ok=True)
        raise HubError(
            502,
            f"{url or repo.repo_id + '/' + file.name}: what was downloaded is not "
            f"the file {'expected' if url else 'the Hub published'} (its SHA-256 "
            "differs); it was removed: pull again",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(fetched, dest)
    return dest


class _Hashing:
    """The partial file as the client writes it, hashed as the bytes go by
    (what an earlier pull left is hashed first), so that the SHA-256 check
    needs no second read of the file. A chunk is hashed in a thread of its
    own while it is written and the next one is read (hashlib lets go of the
    GIL), so the check costs the download next to no time. A server that
    answers a range request with the whole file makes the client truncate
    it: what is kept is hashed again (nothing, then). A context manager: its
    thread ends with it."""

    def __init__(self, out: BinaryIO, path: Path) -> None:
        self.out = out
        self.path = path
        self.digest = _sha256_of(path, path.stat().st_size)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="pull-sha256")
        self._pending: Future | None = None

    def __enter__(self) -> "_Hashing":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hasher.shutdown(wait=True)

    def write(self, data: bytes) -> int:
        self._settle()  # chunks are hashed in their order
        self._pending = self._hasher.submit(self.digest.update, data)
        return self.out.write(data)

    def tell(self) -> int:
        return self.out.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.out.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        self._settle()
        kept = self.out.truncate(size)
        self.out.flush()
        self.digest = _sha256_of(self.path, kept)
        return kept

    def flush(self) -> None:
        self.out.flush()

    def hexdigest(self) -> str:
        self._settle()
        return self.digest.hexdigest()

    def _settle(self) -> None:
        """The chunk being hashed, hashed."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None


def _sha256_of(path: Path, length: int) -> "hashlib._Hash":
    """The running SHA-256 of the first `length` bytes of the file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while length > 0 and (chunk := handle.read(min(1 << 20, length))):
            digest.update(chunk)
            length -= len(chunk)
    return digest


def _room_for(file: HubFile, folder: Path, left: int, margin_bytes: int) -> None:
    """HubError (507) unless the disk holds the `left` bytes and the margin."""
    free = shutil.disk_usage(folder).free
    if free < left + margin_bytes:
        raise HubError(
            507,
            f"{file.name} needs {left / GIB:.2f} GiB more and the disk must keep "
            f"{margin_bytes / GIB:.2f} GiB free; {folder} has "
            f"{free / GIB:.2f} GiB free",
        )


def _matches(path: Path, file: HubFile) -> bool:
    """Whether the file on disk is the one the Hub lists: its size, and its
    SHA-256 where the Hub publishes one (a large file)."""
    size = path.stat().st_size
    if size != file.size:
        return False
    return not file.sha256 or _sha256_of(path, size).hexdigest() == file.sha256


def _reporting(
    report: Callable[[Progress], None] | None,
    size: int,
    folder: Path,
    margin_bytes: int,
) -> type[tqdm]:
    """A progress bar class for the client that draws nothing and tells
    `report` the bytes so far (a resumed download starts at its `initial`).
    Every DISK_CHECK_EVERY_S it looks at the disk again: when others have
    filled it to under half the margin, the download stops (HubError 507),
    keeping what it fetched for a later pull."""
    started = time.monotonic()
    checked = [started]

    class Reporting(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = int(kwargs.get("initial") or 0)

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            now = time.monotonic()
            if now - checked[0] >= DISK_CHECK_EVERY_S:
                checked[0] = now
                free = shutil.disk_usage(folder).free
                if free < margin_bytes // 2:
                    raise HubError(
                        507,
                        f"the disk of {folder} is nearly full ({free / GIB:.2f} GiB "
                        f"free, under half the {margin_bytes / GIB:.2f} GiB margin): "
                        "the download stopped, keeping what it fetched; free room, "
                        "then pull again to continue",
                    )
            if report is not None:
                report(Progress(self.done, size, time.monotonic() - started))
            return None

    return Reporting


# -- a model pulled: what to pull, and its row once pulled ------------------------

# `hf:ORG/REPO[:QUANTIZATION | /FILE]`: a repository on the Hub and its GGUF
# file, by quantization or by name (the repository's only GGUF file if neither).
SOURCE = re.compile(
    r"^hf:(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+)|/(?P<file>.+))?$"
)


class PullPlan(BaseModel):
    """A pull decided before a byte of weights is downloaded: the repository
    at its commit, the files to fetch, what the model is and needs (read from
    its files' headers), and its name. Kept on the pull's row as JSON: the
    worker that downloads reads it back (unknown keys refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    repo_id: str
    commit: str
    files: tuple[HubFile, ...]
    name: str
    format: str
    task: str
    # The model's path under its repository's folder: its GGUF file's name,
    # or "" for the folder itself (a transformers repository).
    model_file: str = ""
    projector: str = ""  # the vision projector's file name, one of `files`
    architecture: str = ""
    context_length: int = 0
    needs_mib: float = 0.0  # served at its default context, one slot
    # A transformers model's parameters by safetensors dtype (F32, BF16 ...),
    # from its weights' headers; {} for a GGUF file or .bin weights.
    parameters: dict[str, int] = Field(default_factory=dict)
    # An https:// source's address: its one file comes from there, not the Hub.
    url: str = ""

    @property
    def repo(self) -> HubRepo:
        """The repository at the plan's commit, as far as the plan fetches it."""
        return HubRepo(repo_id=self.repo_id, commit=self.commit, files=self.files)

    @property
    def size(self) -> int:
        """Bytes to download, every file together."""
        return sum(f.size for f in self.files)

    def path(self, models_dir: Path) -> Path:
        """Where the model is once pulled: its file, or its folder."""
        folder = model_folder(models_dir, self.repo_id)
        return folder / self.model_file if self.model_file else folder


def pull_plan(
    source: str,
    *,
    name: str = "",
    revision: str = "main",
    sha256: str = "",
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> PullPlan:
    """Read what `source` names (hf:ORG/REPO[:QUANT | /FILE]: a GGUF file, or
    with neither a repository without GGUF files, a transformers or
    sentence-transformers model; or https://HOST/PATH/NAME.gguf) and check
    the model's name is free; HubError (400 a bad source, 404, 401, 409 a
    name taken) before anything is downloaded. `sha256` is for a source that
    does not publish one (an https:// address, where it is required); the
    Hub's own is checked."""
    if is_url(source):
        return _url_plan(source, name=name, sha256=url_checked(source, sha256))
    found = SOURCE.match(source)
    if found is None:
        raise HubError(
            400,
            f"{source!r} is not hf:ORG/REPO[:QUANTIZATION | /FILE] nor an "
            "https:// address",
        )
    if sha256:
        raise HubError(400, "the Hub publishes each file's SHA-256: give none")
    repo = hub_repo(found["repo"], revision, endpoint=endpoint, token=token)
    wanted = found["quant"] or found["file"] or ""
    if not wanted and not repo.gguf_files():
        return _folder_plan(source, repo, name=name, endpoint=endpoint, token=token)
    file = repo.gguf_file(wanted)
    name = name or default_name(repo.repo_id, file)
    name_free(name)
    facts = gguf_facts(repo, file, endpoint=endpoint, token=token)
    projector = repo.projector()
    return PullPlan(
        source=source,
        repo_id=repo.repo_id,
        commit=repo.commit,
        files=(file, projector) if projector else (file,),
        name=name,
        format=ModelFormat.GGUF,
        task=facts.task,
        model_file=file.name,
        projector=projector.name if projector else "",
        architecture=facts.architecture,
        context_length=facts.context_length,
        needs_mib=facts.needs_mib(),
    )


def _folder_plan(
    source: str,
    repo: HubRepo,
    *,
    name: str,
    endpoint: str | None,
    token: str | bool | None,
) -> PullPlan:
    """The plan of a transformers or sentence-transformers repository: its
    allowed files, the model being the folder they land in (hub_folders)."""
    name = name or repo.repo_id.rsplit("/", 1)[-1].lower()
    name_free(name)
    facts = folder_facts(repo, endpoint=endpoint, token=token)
    return PullPlan(
        source=source,
        repo_id=repo.repo_id,
        commit=repo.commit,
        files=facts.files,
        name=name,
        format=facts.format,
        task=facts.task,
        architecture=facts.architecture,
        context_length=facts.context_length,
        needs_mib=facts.needs_mib,
        parameters=facts.parameters,
    )


def _url_plan(source: str, *, name: str, sha256: str) -> PullPlan:
    """The plan of a GGUF file at an address (pull_url): its size and header
    read before the download, its folder named after the address."""
    name = name or url_name(source)
    name_free(name)
    file = url_file(source, sha256)
    facts = url_facts(source, file)
    return PullPlan(
        source=source,
        repo_id=url_folder(source),
        commit="",
        files=(file,),
        name=name,
        format=ModelFormat.GGUF,
        task=facts.task,
        model_file=file.name,
        architecture=facts.architecture,
        context_length=facts.context_length,
        needs_mib=facts.needs_mib(),
        url=source,
    )


def name_free(name: str) -> None:
    """HubError (409) when a model or a pull in flight has the name."""
    from .models import PULL_OPEN, ModelPull

    if ModelConfig.objects.filter(name=name).exists():
        raise HubError(409, f"a model named {name} exists: give another (--name)")
    if ModelPull.objects.filter(name=name, status__in=PULL_OPEN).exists():
        raise HubError(409, f"a pull of a model named {name} is under way")


def default_name(repo_id: str, file: HubFile) -> str:
    """The repository's name, lower-case, and the file's quantization."""
    base = repo_id.rsplit("/", 1)[-1].lower().removesuffix("-gguf")
    return f"{base}:{file.quantization.lower()}" if file.quantization else base


def pull_files(
    plan: PullPlan,
    models_dir: Path,
    *,
    progress: Callable[[Progress], None] | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    margin_bytes: int = DISK_MARGIN_BYTES,
) -> Path:
    """Every file of the plan in its place (pull_file, one after another,
    progress counted over all of them); the model's path."""
    started = time.monotonic()
    before = 0
    for file in plan.files:

        def counted(step: Progress, before: int = before) -> None:
            if progress is not None:
                progress(
                    Progress(before + step.done, plan.size, time.monotonic() - started)
                )

        pull_file(
            plan.repo,
            file,
            models_dir,
            progress=counted,
            endpoint=endpoint,
            token=token,
            margin_bytes=margin_bytes,
            url=plan.url,
        )
        before += file.size
    if progress is not None:
        progress(Progress(plan.size, plan.size, time.monotonic() - started))
    return plan.path(models_dir)


def pull_record(plan: PullPlan, path: Path) -> ModelConfig:
    """The pulled model's row (its format, and its task read from its file;
    its projector beside it) and its inspection queued; ValidationError for a
    row the catalog refuses."""
    models_dir = Path(settings.MODELS_DIR)
    projector = path.parent / plan.projector if plan.projector else None
    model = ModelConfig(
        name=plan.name,
        format=plan.format,
        path=_under(models_dir, path),
        projector=_under(models_dir, projector) if projector else "",
        task=plan.task,
    )
    model.full_clean()
    with transaction.atomic():
        model.save()
        model_inspection_queue(model=model)
    return model


def _under(models_dir: Path, path: Path) -> str:
    """The path relative to the models directory when it is under it (as
    every node's copy is found), else as it is."""
    return str(
        path.relative_to(models_dir) if path.is_relative_to(models_dir) else path
    )
