"""A host's disk for models: how full the models directory's filesystem is and
what each catalog model's files take on it, and deleting a model's files from
this host.

`disk_report()` measures this host (each node's supervisor sends it with its
heartbeat, inside `hardware`; on one host the dashboard and the admin ask it
directly): the filesystem's total, free and used MiB, and per catalog model
the MiB of its files here (its path, file or folder, and its projector). A
model whose files are not here is absent; one whose path cannot be read is
left out alone (named under `unreadable`). Walking the models' folders costs
disk reads, so a report is measured at most every DISK_EVERY_S and kept.

`model_files_delete(model=...)` removes a model's files from this host: what
`model_files_plan` lists (its path and its projector, and the partial files of
a pull of them in MODELS_DIR/.pulls), only what lies under MODELS_DIR and is
no other model's, and refuses (ModelInUse, the reason) while an engine of
this host holds the model, a pull in flight writes into its folder, or, on a
node of a cluster, its replica is placed on one of the node's engines (the
node's supervisor would load it again).
"""

import logging
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError
from django.db.models import Q

from catalog.models import (
    PULL_OPEN,
    ModelConfig,
    ModelPathError,
    ModelPull,
    model_path_resolve,
)
from cluster.identity import identity_read
from cluster.models import Node

from .models import EngineState, EngineStatus
from .selectors import routing_snapshot

log = logging.getLogger("roundhouse.fleet")

# A report is measured again at most this often (the heartbeat asks every 2 s).
DISK_EVERY_S = 30.0
MIB = 2**20
# Where pulls keep their partial files, inside the models directory
# (catalog/pull.py STAGING and PARTIAL, which fleet reads but does not write).
PULLS_DIR = ".pulls"
PARTIAL = ".partial"
# Engine states whose resident models are not in memory any more.
DOWN = frozenset({EngineStatus.STOPPED, EngineStatus.CRASHED})


class ModelInUse(Exception):
    """A model's files that may not be deleted from this host now; str() is
    the reason ("loaded on cpu0", "placed on cpu0 (replica 1)")."""


# -- the report -------------------------------------------------------------------


def filesystem_mib(folder: Path) -> dict:
    """The total, free and used MiB of the filesystem holding `folder` (its
    nearest existing parent while it does not exist yet); OSError when none
    can be read."""
    folder = Path(folder)
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    usage = shutil.disk_usage(folder)
    return {
        "total_mib": round(usage.total / MIB),
        "free_mib": round(usage.free / MIB),
        "used_mib": round(usage.used / MIB),
    }


def files_bytes(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """The bytes of a file, or of a folder's files together (links to files
    counted by their target, each file once however many names it has;
    links to folders not followed); FileNotFoundError when `path` is not
    there, OSError when it cannot be read."""
    seen = set() if seen is None else seen
    info = path.stat()
    if not path.is_dir():
        return _counted(info, seen)
    total = 0
    for root, _dirs, files in os.walk(path, onerror=_raise):
        for name in files:
            try:
                total += _counted(os.stat(os.path.join(root, name)), seen)
            except FileNotFoundError:
                continue  # a dangling link, or gone meanwhile
    return total


def _counted(info: os.stat_result, seen: set[tuple[int, int]]) -> int:
    key = (info.st_dev, info.st_ino)
    if key in seen:
        return 0
    seen.add(key)
    return info.st_size


def _raise(error: OSError) -> None:
    raise error


def model_paths(model: ModelConfig) -> list[Path]:
    """The model's paths on this host: its file or folder, and its projector
    when it has one; ModelPathError for a path this host cannot use."""
    paths = [model.resolved_path]
    projector = getattr(model, "projector", "")
    if projector:
        paths.append(model_path_resolve(projector))
    return paths


def model_bytes_here(model: ModelConfig) -> int | None:
    """What the model's files take on this host (None: none of them is
    here); OSError or ModelPathError for a path that cannot be read."""
    seen: set[tuple[int, int]] = set()
    total, found = 0, False
    for path in model_paths(model):
        try:
            total += files_bytes(path, seen)
        except FileNotFoundError:
            continue
        found = True
    return total if found else None


def disk_measure(models_dir: Path | None = None) -> dict:
    """This host's disk for models, measured now: the models directory, its
    filesystem's total, free and used MiB, each catalog model's files here in
    MiB by name (a model whose files are not here is absent), and why each
    model left out could not be measured. Raises nothing for one model, nor
    for a database that cannot be read (the models are then missing and
    `unreadable` says why)."""
    models_dir = Path(models_dir or settings.MODELS_DIR)
    report: dict = {"models_dir": str(models_dir)}
    try:
        report.update(filesystem_mib(models_dir))
    except OSError as error:
        report["error"] = f"cannot read the disk of {models_dir}: {error}"
    sizes: dict[str, float] = {}
    unreadable: dict[str, str] = {}
    try:
        models = list(ModelConfig.objects.order_by("name"))
    except DatabaseError as error:
        models = []
        unreadable["catalog"] = f"the catalog cannot be read: {error}"
    for model in models:
        try:
            size = model_bytes_here(model)
        except (OSError, ModelPathError) as error:
            unreadable[model.name] = str(error) or type(error).__name__
            continue
        if size is not None:
            sizes[model.name] = round(size / MIB, 2)
    report["models"] = sizes
    report["unreadable"] = unreadable
    return report


class DiskReports:
    """The last report of each models directory, measured again once it is
    older than `every_s` (safe from several threads: one measures at a
    time)."""

    def __init__(self, every_s: float = DISK_EVERY_S) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[float, dict]] = {}

    def report(self, models_dir: Path | None = None) -> dict:
        """The report of `models_dir` (default: MODELS_DIR), at most every_s old."""
        key = str(models_dir or settings.MODELS_DIR)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and time.monotonic() - kept[0] < self.every_s:
                return kept[1]
            report = disk_measure(Path(key))
            if "catalog" not in report["unreadable"]:  # measured whole: kept
                self._kept[key] = (time.monotonic(), report)
            return report

    def forget(self) -> None:
        """Measure again at the next ask (after deleting files)."""
        with self._lock:
            self._kept.clear()


_reports = DiskReports()


def disk_report(models_dir: Path | None = None) -> dict:
    """This host's disk for models (disk_measure), measured at most every
    DISK_EVERY_S: cheap to ask at every heartbeat or dashboard update."""
    return _reports.report(models_dir)


def disks_overview() -> list[dict]:
    """The disks the dashboard shows: each node's (not revoked) as its last
    heartbeat reported it (`node`: its name; a node that reported none has
    no numbers), or, without nodes, this host's measured here (`node` "")."""
    nodes = Node.objects.filter(revoked_at__isnull=True).order_by("name")
    rows = list(nodes.values_list("name", "hardware"))
    if not rows:
        return [{"node": "", **disk_report()}]
    return [
        {"node": name, **((hardware or {}).get("disk") or {})}
        for name, hardware in rows
    ]


# -- deleting a model's files ------------------------------------------------------


@dataclass
class FilesPlan:
    """What deleting a model's files from this host would do: the paths it
    removes with their bytes, the paths it keeps and why, and, while the
    model is in use here, why nothing may be deleted."""

    removed: list[tuple[Path, int]] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)
    in_use: str = ""

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.removed)


def this_node() -> str:
    """This host's node name ("" on a host that has not joined a cluster)."""
    identity = identity_read(settings.RUN_DIR)
    return identity.name if identity is not None else ""


def model_in_use_here(*, model: ModelConfig, node: str | None = None) -> str:
    """Why the model's files are in use on this host, or "": an engine of
    this host (of its node, or of no node) holds it, a pull in flight writes
    into its folder, or, on a node, one of its replicas is placed on an
    engine of the node (its supervisor keeps those loaded)."""
    node = this_node() if node is None else node
    here = Q(spec__node__isnull=True)
    if node:
        here |= Q(spec__node__name=node)
    states = EngineState.objects.filter(here).select_related("spec")
    for state in states.order_by("spec__order", "spec__name"):
        if state.status not in DOWN and model.name in state.resident_model_names:
            return f"loaded on {state.spec.name}"
    pulling = _pulled_into(model)
    if pulling:
        return f"being pulled into its folder (the pull of {pulling})"
    if node:
        snapshot = routing_snapshot()
        for replica, engine in enumerate(snapshot.placed(model.name), start=1):
            if snapshot.engines[engine].node == node:
                return f"placed on {engine} (replica {replica})"
    return ""


def _pulled_into(model: ModelConfig) -> str:
    """The name of a pull in flight whose repository's folder holds the
    model's path or lies in it (its partial files and the file it finishes
    would go with the model's), or ""."""
    try:
        path = _real(model.resolved_path)
    except ModelPathError:
        return ""
    models_dir = _real(Path(settings.MODELS_DIR))
    if path is None or models_dir is None:
        return ""
    for name, plan in ModelPull.objects.filter(status__in=PULL_OPEN).values_list(
        "name", "plan"
    ):
        repo_id = (plan or {}).get("repo_id") if isinstance(plan, dict) else None
        if not repo_id:
            continue
        folder = models_dir / repo_id.replace("/", "--")
        if path.is_relative_to(folder) or folder.is_relative_to(path):
            return name
    return ""


def _real(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


def _others_paths(model: ModelConfig) -> list[Path]:
    """Every other model's paths here, as spelt and with links resolved."""
    paths = []
    for other in ModelConfig.objects.exclude(pk=model.pk):
        try:
            spelt = model_paths(other)
        except ModelPathError:
            continue
        for path in spelt:
            paths.append(path)
            real = _real(path)
            if real is not None:
                paths.append(real)
    return paths


def _overlaps(path: Path, others: list[Path]) -> bool:
    """Whether `path` is, holds or lies in one of `others`."""
    return any(
        other == path or other.is_relative_to(path) or path.is_relative_to(other)
        for other in others
    )


def _freed_bytes(path: Path) -> int:
    """The bytes removing `path` gives back: its regular files (a link
    removed frees nothing of its target); OSError when it cannot be read."""
    if path.is_symlink():
        return 0
    if not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path, onerror=_raise):
        for name in files:
            item = os.lstat(os.path.join(root, name))
            if not stat.S_ISLNK(item.st_mode):
                total += item.st_size
    return total


def _partials(models_dir: Path, path: Path) -> list[Path]:
    """The partial files a pull of `path` (under models_dir) keeps in
    models_dir/.pulls: the file's `.partial`, or a folder's own staging
    folder."""
    relative = path.relative_to(models_dir)
    staging = models_dir / PULLS_DIR / relative
    return [staging.with_name(staging.name + PARTIAL), staging]


def model_files_plan(*, model: ModelConfig) -> FilesPlan:
    """What model_files_delete would remove from this host (and keep, and
    why), and whether the model is in use here. Reads, deletes nothing."""
    plan = FilesPlan(in_use=model_in_use_here(model=model))
    models_dir = _real(Path(settings.MODELS_DIR))
    try:
        paths = model_paths(model)
    except ModelPathError as error:
        plan.kept.append((Path(model.path), str(error)))
        return plan
    if models_dir is None:
        return plan
    others = _others_paths(model)
    candidates: list[Path] = []
    for path in paths:
        real = _real(path)
        if real is None or real == models_dir or not real.is_relative_to(models_dir):
            if os.path.lexists(path):
                plan.kept.append((path, "outside the models directory"))
            continue
        if os.path.lexists(path):
            if _overlaps(path, others) or _overlaps(real, others):
                plan.kept.append((path, "another model's files too"))
            else:
                candidates.append(real)
        # A pull's partial files, even when the model's own are gone.
        for partial in _partials(models_dir, real):
            if os.path.lexists(partial) and not _overlaps(partial, others):
                candidates.append(partial)
    for path in dict.fromkeys(candidates):
        try:
            plan.removed.append((path, _freed_bytes(path)))
        except OSError as error:
            plan.kept.append((path, f"cannot be read: {error}"))
    return plan


def model_files_delete(*, model: ModelConfig) -> int:
    """Delete the model's files from this host (model_files_plan: its file or
    folder, its projector, a pull's partial files; only under MODELS_DIR and
    no other model's); the bytes freed. ModelInUse, with the reason, while an
    engine of this host holds the model or its replica is placed here."""
    plan = model_files_plan(model=model)
    if plan.in_use:
        raise ModelInUse(f"{model.name} is {plan.in_use}")
    models_dir = Path(settings.MODELS_DIR).resolve()
    freed = 0
    for path, size in plan.removed:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        freed += size
        _prune_empty(path.parent, models_dir)
    for path, why in plan.kept:
        log.info("kept %s of model %s: %s", path, model.name, why)
    _reports.forget()
    return freed


def _prune_empty(folder: Path, models_dir: Path) -> None:
    """Remove the folders left empty up to (not including) the models
    directory and its pulls folder."""
    keep = {models_dir, models_dir / PULLS_DIR}
    while folder.is_relative_to(models_dir) and folder not in keep:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty
        folder = folder.parent
