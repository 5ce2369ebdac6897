"""Memory measurement through a real Celery worker process (the broker the
settings choose) and the real probe child: the admin action queues it, the
worker loads each model in a child process with its context and slots, and
the figure lands where the engines' residency decisions read it. Plus the
runner's timeout and a broker that is down."""

import socket

import psutil
import pytest
from django.urls import reverse

from catalog.measurement import measure_memory
from catalog.models import JobState, ModelConfig
from catalog.selectors import models_servable_by
from tests.conftest import run_python
from tests.factories import ModelConfigFactory
from tests.platform.live import database_url
from tests.waiting import wait_for


def finished(name: str):
    model = ModelConfig.objects.get(name=name)
    return model if model.memory_job in (JobState.DONE, JobState.FAILED) else None


def test_a_worker_measures_the_selected_models(worker, admin_client, models_dir):
    """Two models selected: SmolLM2 with 2 slots of 512 tokens is measured
    and its figure reaches the engines' model specs; one whose file is gone
    fails with the probe's problem. The change form shows both outcomes."""
    process, log = worker
    smol = ModelConfigFactory(name="smol-measured", context_length=512, slots=2)
    gone = ModelConfigFactory(name="gone-measured", path="gone.gguf")
    response = admin_client.post(
        reverse("admin:catalog_modelconfig_changelist"),
        {"action": "measure_memory", "_selected_action": [smol.pk, gone.pk]}
        | {"index": 0},
    )
    assert response.status_code == 302
    assert ModelConfig.objects.get(pk=smol.pk).memory_job == JobState.QUEUED
    what = f"the measurement (worker log: {log})"
    smol = wait_for(lambda: finished("smol-measured"), timeout=180, what=what)
    gone = wait_for(lambda: finished("gone-measured"), timeout=180, what=what)
    report = smol.memory_report
    assert smol.memory_job == JobState.DONE, smol.memory_job_progress
    assert (report["slots"], report["context"], report["problem"]) == (2, 512, "")
    assert smol.measured_memory_mib == round(report["host_mib"]) > 0
    assert smol.measured_at is not None
    [spec] = [
        spec
        for spec in models_servable_by(capabilities=frozenset({"gguf"}))
        if spec["name"] == "smol-measured"
    ]
    assert spec["measured_mib"] == smol.measured_memory_mib
    assert gone.memory_job == JobState.FAILED
    assert gone.memory_job_progress.startswith("not found")
    assert gone.measured_memory_mib is None
    page = admin_client.get(reverse("admin:catalog_modelconfig_change", args=[smol.pk]))
    body = page.content.decode()
    assert f"{report['host_mib']:,.0f} MiB of host memory" in body
    assert "with 2 slot(s) sharing a 1,024-token KV pool" in body
    changelist = admin_client.get(reverse("admin:catalog_modelconfig_changelist"))
    assert "memory: failed (not found" in changelist.content.decode()
    assert process.poll() is None


@pytest.mark.django_db
def test_a_probe_past_its_timeout_is_killed(models_dir):
    """A limit too short for any load: the child is killed, none is left,
    and the problem says why."""
    model = ModelConfigFactory(name="smol-slow", context_length=256, slots=1)
    result = measure_memory(model, timeout_s=0.05)
    assert result.problem == "timed out after 0.05 s"
    probes = [
        child
        for child in psutil.Process().children(recursive=True)
        if "engines.inspection.probe" in child.cmdline()
    ]
    assert probes == []


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once it is closed


QUEUE_WITHOUT_BROKER = """
import django
django.setup()
from catalog.models import ModelConfig
from catalog.services import model_memory_measure_queue
model_memory_measure_queue(model=ModelConfig.objects.get(name="smol-unqueued"))
print("returned")
"""


@pytest.mark.django_db(transaction=True)
def test_a_broker_that_is_down_fails_the_job_and_is_logged():
    """Queueing with no broker listening (Redis on a closed port): the call
    returns, the job says it was not queued, the log says why."""
    ModelConfigFactory(name="smol-unqueued")
    result = run_python(
        QUEUE_WITHOUT_BROKER,
        env={
            "DJANGO_SETTINGS_MODULE": "roundhouse.settings",
            "DATABASE_URL": database_url(),
            "REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0",
        },
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("returned")
    assert "could not queue the memory measurement" in result.stderr
    model = ModelConfig.objects.get(name="smol-unqueued")
    assert model.memory_job == JobState.FAILED
    assert model.memory_job_progress.startswith("not queued:")
