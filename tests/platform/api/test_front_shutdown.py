"""A front stopped with SIGTERM writes the usage rows it still holds. uvicorn
ends such a process by raising the signal again once it has stopped, which
skips atexit hooks: the rows are written on the ASGI lifespan's shutdown."""

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from django.utils import timezone

from api.models import ApiKey, Usage
from tests.conftest import ROOT
from tests.factories import ApiKeyFactory
from tests.platform.api.usage_lock import usage_table_locked
from tests.platform.live import (
    database_url,
    free_port_block,
    front_answers,
    live_database,
)
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def database(django_db_setup, django_db_blocker):
    with live_database(django_db_blocker):
        yield


def post(port: int, key: str) -> int:
    """POST /v1/embeddings for a model that does not exist: a 404 and a row."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/embeddings",
        data=json.dumps({"model": "no-such-model", "input": "x"}).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_front_stopped_with_sigterm_writes_its_queued_usage(
    database, django_db_blocker, tmp_path
):
    """The usage table is locked while the front answers, so the rows wait in
    its writer; SIGTERM; once the front's shutdown has begun the lock goes, and
    every row is in the table when the process has ended."""
    with django_db_blocker.unblock():
        key = ApiKeyFactory(name="stopped-front")
        # Recently used: the requests write nothing but their usage.
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    port = free_port_block(1)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "ROUNDHOUSE_RUN_DIR": str(run_dir),
        "SECRET_KEY": "shutdown-tests-not-secret",
        "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
    }
    env.pop("REDIS_URL", None)
    log_path = tmp_path / "front.log"
    with open(log_path, "wb") as log:
        front = subprocess.Popen(
            [sys.executable, "-m", "roundhouse.serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: front_answers(port), timeout=120, what="the front")
        with django_db_blocker.unblock():
            with usage_table_locked():
                assert [post(port, key.plaintext) for _ in range(5)] == [404] * 5
                front.send_signal(signal.SIGTERM)
                wait_for(
                    lambda: "Waiting for application shutdown" in log_path.read_text(),
                    timeout=60,
                    what="the front's lifespan shutdown",
                )
                assert front.poll() is None  # still writing, behind the lock
        assert front.wait(60) == -signal.SIGTERM
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
    with django_db_blocker.unblock():
        statuses = list(Usage.objects.filter(key=key).values_list("status", flat=True))
        Usage.objects.filter(key=key).delete()
        ApiKey.objects.filter(pk=key.pk).delete()
    assert statuses == [404] * 5, log_path.read_text()
