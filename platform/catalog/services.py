"""Writes of catalog data."""

import logging

from django.db import transaction
from django.utils import timezone

from .models import ModelConfig

log = logging.getLogger("roundhouse.catalog")

# A new measurement replaces the stored one only when it moved this much: the
# stored figure feeds the engines' configuration, which should not churn.
MEASUREMENT_TOLERANCE = 0.1


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
    return True


def model_inspection_queue(*, model: ModelConfig) -> None:
    """Queue the model's inspection for when the current transaction commits
    (at once outside one): the worker then reads the committed row."""
    from .tasks import inspect_model

    model_id = model.pk

    def send() -> None:
        try:
            inspect_model.delay(model_id)
        except Exception:  # the broker is down: the save stands, say so
            log.exception("could not queue the inspection of model %s", model_id)

    transaction.on_commit(send)
