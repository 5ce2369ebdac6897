"""Placement and keep-alive agree on a cluster (issue 31, point 19): a model
placed on an engine stays loaded there past its keep-alive, never unloaded
when idle and loaded again by the supervisor; the same model loaded on
another engine of the node, outside its placement, is unloaded after its
keep-alive as on one host. A real supervisor (`supervise --node a`) with two
engines on node a; PostgreSQL only (cluster mode needs it)."""

import json
import os
import signal
import subprocess
import sys

import pytest
from django.db import connection

from catalog.models import ModelConfig
from cluster.models import Node
from cluster.services import node_create
from fleet.models import EngineSpec, ServerSettings
from tests.conftest import ROOT
from tests.platform.fleet.live_fleet import EMBEDDER, Fleet, state_of, stop_leftovers
from tests.platform.live import database_url, free_port_block
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="cluster mode needs PostgreSQL; SQLite runs one node (no placement)",
    ),
]

KEEP_ALIVE_S = 2


def resident(fleet: Fleet, engine: str) -> dict:
    """The models the engine holds now, by name (its own state)."""
    return {model.name: model for model in fleet.client(engine).state().models}


def test_a_placed_model_stays_loaded_past_its_keep_alive(models_dir, tmp_path):
    """The embedder (keep-alive 2 s) placed on a-placed by its pin: loaded
    there by the supervisor, then idle for three keep-alives and more, it is
    still resident with the same load time (an unload and reload would
    change it). Control: the same model loaded on a-other, where it is not
    placed, is unloaded after its keep-alive."""
    port = free_port_block(3)
    ServerSettings.load()
    node, token = node_create(name="a", address="127.0.0.1")
    Node.objects.filter(pk=node.pk).update(relay_port=port + 2)
    for index, name in enumerate(("a-placed", "a-other")):
        EngineSpec.objects.create(
            name=name, backend="cpu", node=node, port=port + index, order=index
        )
    ModelConfig.objects.all().delete()
    ModelConfig.objects.create(
        name=EMBEDDER,
        format="embedding",
        task="embedding",
        path="all-MiniLM-L6-v2",
        keep_alive_s=KEEP_ALIVE_S,
        engine_pin="a-placed",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    temperatures = tmp_path / "temperatures.json"
    temperatures.write_text(json.dumps({"cpu": 50}))
    env = {
        **os.environ,
        "ROUNDHOUSE_THERMAL_FILE": str(temperatures),
        "DATABASE_URL": database_url(),
        "ROUNDHOUSE_RUN_DIR": str(run_dir),
        "ROUNDHOUSE_MODELS_DIR": str(models_dir),
        "ROUNDHOUSE_JOIN_TOKEN": token,
        "ROUNDHOUSE_RELAY_BIND": "127.0.0.1",
        "ROUNDHOUSE_CLUSTER_TLS": "0",
        "SECRET_KEY": "placed-keep-alive-tests-not-secret",
    }
    fleet = Fleet(run_dir=run_dir, env=env, base_port=port, temperatures=temperatures)
    with open(run_dir / "supervisor-test.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "supervise", "--node", "a"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    fleet.processes.append(process)
    try:

        def ready(name: str, holding: bool) -> bool:
            assert process.poll() is None, fleet.supervisor_log()
            state = state_of(name)
            return (
                state is not None
                and state.status == "ready"
                and (EMBEDDER in state.resident_model_names) == holding
            )

        wait_for(lambda: ready("a-placed", True), timeout=180, what="a-placed")
        wait_for(lambda: ready("a-other", False), timeout=180, what="a-other")
        loaded_at = resident(fleet, "a-placed")[EMBEDDER].loaded_at
        # Control: outside its placement the keep-alive applies.
        fleet.client("a-other").load(EMBEDDER, timeout=120)
        assert EMBEDDER in resident(fleet, "a-other")
        wait_for(
            lambda: EMBEDDER not in resident(fleet, "a-other"),
            timeout=60,
            what="the model unloaded from a-other after its keep-alive",
        )
        # Placed: idle for three keep-alives and more, and never reloaded.

        def idle_long_or_not_the_same():
            model = resident(fleet, "a-placed").get(EMBEDDER)
            if model is None:
                return ("unloaded", None)
            if model.loaded_at != loaded_at or model.idle_s > 3 * KEEP_ALIVE_S:
                return ("resident", model)
            return None

        outcome, placed = wait_for(
            idle_long_or_not_the_same,
            timeout=60,
            what="the placed model idle for three keep-alives",
        )
        assert outcome == "resident", fleet.supervisor_log()
        assert placed.loaded_at == loaded_at, fleet.supervisor_log()
        assert placed.idle_s > 3 * KEEP_ALIVE_S
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == 0, fleet.supervisor_log()
    finally:
        stop_leftovers(fleet)
