"""Celery tasks of the catalog: thin, by id, idempotent; queued after the
transaction that asks for them commits (services.model_*_queue)."""

from celery import shared_task
from celery.signals import worker_ready

from . import pull_jobs, services


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


@shared_task(name=pull_jobs.PULL_TASK)
def pull_model(pull_id: int) -> str:
    """Download a pull's files (continuing what an earlier run fetched) and
    add its model to the catalog."""
    return pull_jobs.pull_run(pull_id)


@shared_task(name="catalog.resume_pulls")
def resume_pulls() -> list[int]:
    """Queue every open pull that no live worker holds."""
    return pull_jobs.pulls_resume()


@worker_ready.connect
def _resume_pulls_when_ready(**_: object) -> None:
    resume_pulls.delay()
