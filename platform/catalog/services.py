"""Writes of catalog data."""

import logging
from collections.abc import Iterable
from pathlib import Path

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from engines.inspection.messages import QUANTIZATIONS

from .models import JobState, ModelConfig, ModelFormat, ModelPathError

log = logging.getLogger("roundhouse.catalog")

# A new measurement replaces the stored one only when it moved this much: the
# stored figure feeds the engines' configuration, which should not churn.
MEASUREMENT_TOLERANCE = 0.1
# The Celery tasks of the catalog (tasks.py), queued by their names: the task
# module calls these services, never the other way round.
INSPECT_TASK = "catalog.inspect_model"
MEASURE_TASK = "catalog.measure_model"
REQUANTIZE_TASK = "catalog.requantize_model"


def model_memory_record(
    *, name: str, memory_mib: float, device_memory_mib: float = 0.0
) -> bool:
    """Store the memory a load measured for a model (host RAM, and GPU memory
    on a GPU engine); True when either changed."""
    model = ModelConfig.objects.filter(name=name).first()
    if model is None:
        return False
    changed = []
    for field, value in (
        ("measured_memory_mib", memory_mib),
        ("measured_device_memory_mib", device_memory_mib),
    ):
        old = getattr(model, field)
        if value <= 0 or (old and abs(value - old) <= old * MEASUREMENT_TOLERANCE):
            continue
        setattr(model, field, round(value))
        changed.append(field)
    if not changed:
        return False
    model.measured_at = timezone.now()
    model.save(update_fields=[*changed, "measured_at"])
    return True


def model_file_digests_record(*, name: str, digests: dict[str, str]) -> bool:
    """Keep the SHA-256 of a model's files as the catalog's, if it has none
    yet (the first hash wins: a later one never replaces it); True if kept."""
    if not digests:
        return False
    rows = ModelConfig.objects.filter(name=name, file_digests={})
    return rows.update(file_digests=digests) > 0


def model_file_digests_compute(model: ModelConfig) -> dict[str, str]:
    """The SHA-256 of the model's files on this host ({} without files).
    Blocking: reads every byte."""
    from node_link.files import model_digests

    try:
        return model_digests(model.resolved_path)
    except (ModelPathError, OSError, ValueError):
        return {}


def model_inspection_run(*, model_id: int) -> bool:
    """Inspect a model's files now and store the result (False: no such
    model, deleted since the task was queued). Running it twice stores the
    same thing twice."""
    from .inspection import inspect_model_files

    model = ModelConfig.objects.filter(pk=model_id).first()
    if model is None:
        return False
    found = inspect_model_files(model.format, model.resolved_path)
    model.inspection = found.as_dict()
    model.inspected_at = timezone.now()
    model.save(update_fields=["inspection", "inspected_at"])
    if not model.file_digests:  # the first inspection records them
        model_file_digests_record(
            name=model.name, digests=model_file_digests_compute(model)
        )
    return True


def model_inspection_queue(*, model: ModelConfig) -> None:
    """Queue the model's inspection for when the current transaction commits
    (at once outside one): the worker then reads the committed row."""
    model_id = model.pk

    def send() -> None:
        try:
            current_app.send_task(INSPECT_TASK, args=[model_id])
        except Exception:  # the broker is down: the save stands, say so
            log.exception("could not queue the inspection of model %s", model_id)

    transaction.on_commit(send)


# -- background jobs on a model: memory measurement, requantization ------------

# Room for a job's progress text (ModelConfig.*_job_progress).
PROGRESS_LENGTH = 500
# Serving settings a requantized variant starts with, copied from its original
# (not its pin: an operator places the variant, if at all).
VARIANT_COPIED_FIELDS = (
    "task",
    "context_length",
    "slots",
    "batch_window_ms",
    "max_batch_size",
    "keep_alive_s",
    "sampling",
    "chat_template",
    "prompt_cache",
    "share_prompt_cache_across_owners",
    "context_overflow",
)


def _job_write(model_id: int, **fields) -> None:
    """Write a job's fields alone: the rest of the row may be under edit in
    the admin meanwhile, and a job must not undo that edit."""
    fields = {
        name: value[:PROGRESS_LENGTH] if name.endswith("_progress") else value
        for name, value in fields.items()
    }
    ModelConfig.objects.filter(pk=model_id).update(**fields)


def _queue_on_commit(task: str, model_id: int, *, job: str, what: str) -> None:
    """Send the task named `task`, with `model_id`, once the current
    transaction commits (at once outside one). A broker that is down fails the
    job, with the reason, and is logged: the request that asked for it stands."""

    def send() -> None:
        try:
            current_app.send_task(task, args=[model_id])
        except Exception as error:  # the broker is down
            log.exception("could not queue the %s of model %s", what, model_id)
            _job_write(
                model_id,
                **{job: JobState.FAILED, f"{job}_progress": f"not queued: {error}"},
            )

    transaction.on_commit(send)


def model_memory_measure_queue(*, model: ModelConfig) -> None:
    """Mark the model's memory measurement queued, and queue it."""
    _job_write(model.pk, memory_job=JobState.QUEUED, memory_job_progress="queued")
    _queue_on_commit(
        MEASURE_TASK, model.pk, job="memory_job", what="memory measurement"
    )


def model_memory_measure_run(*, model_id: int) -> bool:
    """Measure the model's memory now (a child process loads it with its
    context and slots) and record it where the engines read it (False: no
    such model). Running it again measures again."""
    from .measurement import measure_memory

    model = ModelConfig.objects.filter(pk=model_id).first()
    if model is None:
        return False
    _job_write(
        model_id,
        memory_job=JobState.RUNNING,
        memory_job_progress="loading it with its context and slots",
    )
    result = measure_memory(model)
    report = {**result.model_dump(), "at": timezone.now().isoformat()}
    if result.problem:
        _job_write(
            model_id,
            memory_job=JobState.FAILED,
            memory_job_progress=result.problem,
            memory_report=report,
        )
        return True
    model_memory_record(
        name=model.name,
        memory_mib=result.host_mib,
        device_memory_mib=result.device_mib or 0.0,
    )
    _job_write(
        model_id, memory_job=JobState.DONE, memory_job_progress="", memory_report=report
    )
    return True


def model_requantize_queue(*, model: ModelConfig, quantization: str) -> ModelConfig:
    """The model's variant in `quantization`, marked queued, its job queued.
    The variant made by an earlier request is reused (and refreshed by the
    job); a new one starts disabled, until its file exists. ValueError: not a
    GGUF model, not a known quantization, or the variant's file is another
    model's; ValidationError: the variant's name is taken by another
    model."""
    from .requantize import variant_name, variant_path

    if model.format != ModelFormat.GGUF:
        raise ValueError(f"{model.name} is not a GGUF model")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}")
    with transaction.atomic():
        variant = model.variants.filter(quantized_to=quantization).first()
        if variant is None:
            name = variant_name(model.name, quantization)
            variant = ModelConfig(
                name=name,
                format=model.format,
                path=variant_path(name),
                enabled=False,
                derived_from=model,
                quantized_to=quantization,
                **{field: getattr(model, field) for field in VARIANT_COPIED_FIELDS},
            )
            variant.full_clean()
        owner = _model_using(variant.resolved_path, besides=variant)
        if owner is not None:  # the job would write over another model's file
            raise ValueError(
                f"{model.name}'s variant would be written to {variant.path}, "
                f"which is {owner.name}'s file"
            )
        if variant.pk is None:
            variant.save()
        _job_write(
            variant.pk, requantize_job=JobState.QUEUED, requantize_job_progress="queued"
        )
        _queue_on_commit(
            REQUANTIZE_TASK, variant.pk, job="requantize_job", what="requantization"
        )
    return variant


def _model_using(path: Path, *, besides: ModelConfig) -> ModelConfig | None:
    """Another model whose path is this file, however it is spelt."""
    target = path.resolve()
    others = ModelConfig.objects.all()
    if besides.pk is not None:
        others = others.exclude(pk=besides.pk)
    return next((o for o in others if _real_path(o) == target), None)


def _real_path(model: ModelConfig) -> Path | None:
    """The model's path with links resolved; None for a path this host cannot
    use (that model alone is skipped)."""
    try:
        return model.resolved_path.resolve()
    except (ModelPathError, OSError):
        return None


def model_variant_files_remove(*, models: Iterable[ModelConfig]) -> list[Path]:
    """Remove the files the requantize job wrote for these deleted variants
    (only in the models directory's requantized/ folder, which the job owns;
    one another model still points at, by any spelling of its path, stays);
    the files removed."""
    from .requantize import VARIANTS_DIR

    folder = (Path(settings.MODELS_DIR) / VARIANTS_DIR).resolve()
    # The files the models left point at, however their paths are spelt
    # (absolute, `./`, through a link).
    kept = {_real_path(other) for other in ModelConfig.objects.all()}
    removed = []
    for model in models:
        if model.derived_from_id is None and not model.quantized_to:
            continue
        path = _real_path(model)
        if path is None or path.parent != folder or path in kept:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            log.warning("could not remove %s's file %s: %s", model.name, path, error)
            continue
        removed.append(path)
    return removed


def model_requantize_run(*, variant_id: int) -> bool:
    """Write the variant's file from its original and compare the two here
    (False: no such variant). Running it again rewrites the file and the
    comparison. The first success enables the variant: then it is the
    operator's to disable."""
    from .requantize import requantize

    variant = ModelConfig.objects.filter(pk=variant_id).first()
    if variant is None:
        return False
    original = variant.derived_from
    if original is None or not variant.quantized_to:
        _job_write(
            variant_id,
            requantize_job=JobState.FAILED,
            requantize_job_progress="not a variant of a model in the catalog",
        )
        return True
    first = not variant.comparison
    _job_write(variant_id, requantize_job=JobState.RUNNING)

    def progress(text: str) -> None:
        _job_write(variant_id, requantize_job_progress=text)

    comparison, problem = requantize(
        source=original.resolved_path,
        target=variant.resolved_path,
        quantization=variant.quantized_to,
        progress=progress,
    )
    if problem:
        _job_write(
            variant_id, requantize_job=JobState.FAILED, requantize_job_progress=problem
        )
        return True
    model_inspection_run(model_id=variant_id)  # its file is new: what it says
    fields = {
        "comparison": {**comparison, "measured_at": timezone.now().isoformat()},
        "requantize_job": JobState.DONE,
        "requantize_job_progress": "",
    }
    if first:
        fields["enabled"] = True
    _job_write(variant_id, **fields)
    return True
