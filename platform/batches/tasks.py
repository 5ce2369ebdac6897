"""Celery tasks of the Batch API: thin, by id, idempotent. A batch is queued
when it is created or cancelled (after the transaction commits), again when a
worker starts (a worker killed mid-batch leaves it open) and by beat every
minute (a batch whose worker's lease expired on another host); a batch
already waiting in the broker is not queued again until
services.REQUEUE_AFTER_S has passed (services.batches_resume)."""

from celery import shared_task
from celery.signals import worker_ready

from . import runner, services


@shared_task(name=services.RUN_BATCH_TASK)
def run_batch(batch_id: str) -> None:
    """Answer the batch's lines that are not answered yet, then write its files."""
    runner.run_batch(batch_id)


@shared_task(name="batches.resume")
def resume_batches() -> list[str]:
    """Queue every open batch that no live worker holds."""
    return services.batches_resume()


@worker_ready.connect
def _resume_when_ready(**_: object) -> None:
    resume_batches.delay()
