"""Celery tasks of the catalog: thin, by id, idempotent; queued after the
transaction that asks for them commits (services.model_inspection_queue)."""

from celery import shared_task

from . import services


@shared_task(name="catalog.inspect_model")
def inspect_model(model_id: int) -> None:
    """Read what the model's files say and store it on the model."""
    services.model_inspection_run(model_id=model_id)
