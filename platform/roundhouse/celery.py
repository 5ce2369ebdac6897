"""The Celery application: configuration from Django settings (CELERY_* names);
a worker builds its long-lived parts when it starts."""

import os

from celery import Celery
from celery.signals import celeryd_after_setup, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")

app = Celery("roundhouse")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _worker_start(**_: object) -> None:
    """Build the worker's long-lived parts (api.parts) when it starts: the
    gateway its batch lines go through and the usage writer. Imported here,
    not at the top: Django is set up by then."""
    from api.gateway import front_gateway
    from api.usage import usage_writer

    front_gateway.start()
    usage_writer.start()


@celeryd_after_setup.connect
def _node_queues(sender: str, instance, **_: object) -> None:
    """A worker on a node of a cluster (its host joined: the node's identity
    is in the run dir) also takes the pulls that must run on that node
    (catalog.pull_jobs.pull_queue_name), besides the queues it was given."""
    from django.conf import settings

    from catalog.pull_jobs import pull_queue_name
    from cluster.identity import identity_read

    identity = identity_read(settings.RUN_DIR)
    if identity is not None:
        instance.app.amqp.queues.select_add(pull_queue_name(identity.name))
