"""Rows and an environment for a real supervisor (see live_fleet.py)."""

import json
import os

import pytest

from catalog.models import ModelConfig
from fleet.models import ConcurrencySettings, EngineSpec, ServerSettings
from fleet.supervisor_lock import SupervisorLock
from tests.platform.fleet.live_fleet import (
    CHAT,
    EMBEDDER,
    DatabaseSwitch,
    Fleet,
    stop_leftovers,
)
from tests.platform.live import database_url, free_port_block
from tests.waiting import wait_for


@pytest.fixture
def fleet(transactional_db, tmp_path, settings):
    """Rows for one cpu engine serving MiniLM, and the supervisor's environment."""
    base_port = free_port_block()
    server = ServerSettings.load()
    server.base_port = base_port
    server.save()
    EngineSpec.objects.get_or_create(name="cpu0", defaults={"backend": "cpu"})
    ModelConfig.objects.get_or_create(
        name=EMBEDDER,
        defaults={
            "format": "embedding",
            "task": "embedding",
            "path": "all-MiniLM-L6-v2",
        },
    )
    ModelConfig.objects.update_or_create(
        name=CHAT,
        defaults={
            "format": "gguf",
            "task": "chat",
            "path": "SmolLM2-135M-Instruct.Q4_1.gguf",
            "context_length": 256,
            "sampling": {"max_tokens": 3, "temperature": 0},
        },
    )
    ConcurrencySettings.load()
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    temperatures = tmp_path / "temperatures.json"
    temperatures.write_text(json.dumps({"cpu": 50}))
    env = {
        "ROUNDHOUSE_THERMAL_FILE": str(temperatures),
        **os.environ,
        "DATABASE_URL": database_url(),
        "ROUNDHOUSE_RUN_DIR": str(run_dir),
        "ROUNDHOUSE_MODELS_DIR": str(settings.MODELS_DIR),
        "SECRET_KEY": "supervisor-tests-not-secret",
    }
    fleet = Fleet(
        run_dir=run_dir, env=env, base_port=base_port, temperatures=temperatures
    )
    yield fleet
    stop_leftovers(fleet)
    holder = SupervisorLock(run_dir)
    wait_for(lambda: not holder.is_held(), timeout=60, what="supervisor gone")


@pytest.fixture
def database_switch(tmp_path):
    """The test database through a path the test can cut (DatabaseSwitch)."""
    switch = DatabaseSwitch(tmp_path)
    yield switch
    switch.close()
