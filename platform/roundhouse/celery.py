"""The Celery application: configuration from Django settings (CELERY_* names);
a worker builds its long-lived parts when it starts."""

import os

from celery import Celery
from celery.signals import worker_init

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
