"""Celery tasks of the catalog: thin, by id, idempotent; queued after the
transaction that asks for them commits (services.model_*_queue)."""

from celery import shared_task

from . import services


@shared_task(name=services.INSPECT_TASK)
def inspect_model(model_id: int) -> None:
    """Read what the model's files say and store it on the model."""
    services.model_inspection_run(model_id=model_id)


@shared_task(name=services.MEASURE_TASK)
def measure_model(model_id: int) -> None:
    """Load the model in a child process and record the memory it took."""
    services.model_memory_measure_run(model_id=model_id)


@shared_task(name=services.REQUANTIZE_TASK)
def requantize_model(variant_id: int) -> None:
    """Write a requantized variant's file and compare it with its original."""
    services.model_requantize_run(variant_id=variant_id)
