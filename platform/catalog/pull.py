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
with the Hub's SHA-256 is not downloaded again."""

import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers
from tqdm.auto import tqdm

from .hub import (
    GgufFacts,
    HubError,
    HubFile,
    HubRepo,
    gguf_facts,
    hub_endpoint,
    hub_errors,
    hub_repo,
    hub_token,
)
from .models import ModelConfig, ModelFormat
from .services import model_inspection_queue

# What a download leaves free on the models' disk, at the least.
DISK_MARGIN_BYTES = 1 << 30
# Where downloads in progress are kept, inside the models directory (the same
# filesystem: the finished file takes its place with one rename).
STAGING = ".pulls"
# A download in progress: the file's name with this suffix, in STAGING.
PARTIAL = ".partial"
GIB = 1 << 30


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
) -> Path:
    """The file in its place (model_folder / its name), downloaded if it is
    not there yet; HubError when the Hub refuses, the disk has no room
    (507) or what came is not what the Hub published (502: removed)."""
    dest = model_folder(models_dir, repo.repo_id) / file.name
    if dest.is_file() and _matches(dest, file):
        return dest
    staging = model_folder(Path(models_dir) / STAGING, repo.repo_id)
    fetched = staging / (file.name + PARTIAL)
    fetched.parent.mkdir(parents=True, exist_ok=True)
    if fetched.exists() and fetched.stat().st_size > file.size:
        fetched.unlink()  # not a start of this file: start over
    done = fetched.stat().st_size if fetched.exists() else 0
    _room_for(file, fetched.parent, file.size - done, margin_bytes)
    token = hub_token() if token is None else token
    endpoint = hub_endpoint(endpoint)
    with hub_errors(repo.repo_id, repo.commit):
        url = hf_hub_url(
            repo.repo_id, file.name, revision=repo.commit, endpoint=endpoint
        )
        location = get_hf_file_metadata(url, token=token, endpoint=endpoint).location
        headers = build_hf_headers(token=token)
        if urlsplit(location).netloc != urlsplit(url).netloc:
            headers.pop("authorization", None)  # a CDN's signed address: no token
        with open(fetched, "ab") as out:
            if done < file.size:
                http_get(
                    location,
                    out,
                    resume_size=done,
                    headers=headers,
                    expected_size=file.size,
                    displayed_filename=file.name,
                    tqdm_class=_reporting(progress, file.size),
                )
    if not _matches(fetched, file):
        fetched.unlink(missing_ok=True)
        raise HubError(
            502,
            f"{repo.repo_id}/{file.name}: what was downloaded is not the file the "
            "Hub published (its SHA-256 differs); it was removed: pull again",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(fetched, dest)
    return dest


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
    if path.stat().st_size != file.size:
        return False
    if not file.sha256:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == file.sha256


def _reporting(report: Callable[[Progress], None] | None, size: int) -> type[tqdm]:
    """A progress bar class for the client that draws nothing and tells
    `report` the bytes so far (a resumed download starts at its `initial`)."""
    started = time.monotonic()

    class Reporting(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = int(kwargs.get("initial") or 0)

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
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


@dataclass(frozen=True)
class PullPlan:
    """A pull decided before a byte of weights is downloaded: the repository
    at its commit, the file, what its header says, the new model's name."""

    repo: HubRepo
    file: HubFile
    facts: GgufFacts
    name: str


def pull_plan(
    source: str,
    *,
    name: str = "",
    revision: str = "main",
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> PullPlan:
    """Read what `source` names (hf:ORG/REPO[:QUANT | /FILE]) and check the
    model's name is free; HubError (400 a bad source, 404, 401, 409 a name
    taken) before anything is downloaded."""
    found = SOURCE.match(source)
    if found is None:
        raise HubError(400, f"{source!r} is not hf:ORG/REPO[:QUANTIZATION | /FILE]")
    repo = hub_repo(found["repo"], revision, endpoint=endpoint, token=token)
    file = repo.gguf_file(found["quant"] or found["file"] or "")
    name = name or default_name(repo.repo_id, file)
    if ModelConfig.objects.filter(name=name).exists():
        raise HubError(409, f"a model named {name} exists: give another (--name)")
    facts = gguf_facts(repo, file, endpoint=endpoint, token=token)
    return PullPlan(repo=repo, file=file, facts=facts, name=name)


def default_name(repo_id: str, file: HubFile) -> str:
    """The repository's name, lower-case, and the file's quantization."""
    base = repo_id.rsplit("/", 1)[-1].lower().removesuffix("-gguf")
    return f"{base}:{file.quantization.lower()}" if file.quantization else base


def pull_record(plan: PullPlan, path: Path) -> ModelConfig:
    """The pulled model's row (its format, and its task read from its file)
    and its inspection queued; ValidationError for a row the catalog refuses."""
    models_dir = Path(settings.MODELS_DIR)
    # Under the models directory: relative, as every node's copy is found.
    relative = path.is_relative_to(models_dir)
    model = ModelConfig(
        name=plan.name,
        format=ModelFormat.GGUF,
        path=str(path.relative_to(models_dir) if relative else path),
        task=plan.facts.task,
    )
    model.full_clean()
    with transaction.atomic():
        model.save()
        model_inspection_queue(model=model)
    return model
