"""A real Celery worker process for the catalog's task tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.platform.live import database_url

ROOT = Path(__file__).resolve().parents[3]


def start_worker(log: Path) -> subprocess.Popen:
    """A worker on the broker the settings choose (kombu's filesystem transport
    in the run dir by default, Redis when REDIS_URL is set), against the test
    database and the models directory the settings name now, its output in
    `log` (appended)."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        # The same run dir: the filesystem broker's queue is a folder in it.
        "ROUNDHOUSE_RUN_DIR": str(settings.RUN_DIR),
        "ROUNDHOUSE_MODELS_DIR": str(settings.MODELS_DIR),
        "SECRET_KEY": "worker-tests-not-secret",
        "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
    }
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "roundhouse", "worker"]
            + ["--pool", "solo", "--loglevel", "INFO"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stop_worker(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@pytest.fixture
def worker(transactional_db, tmp_path):
    """A worker process (start_worker) for the test, stopped after it."""
    log = tmp_path / "worker.log"
    process = start_worker(log)
    yield process, log
    stop_worker(process)
