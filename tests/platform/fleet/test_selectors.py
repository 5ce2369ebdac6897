"""What the supervisor and routing read from the fleet's rows."""

import json
from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from engines.launch.config import EngineConfig, VendorThresholds
from fleet.models import EngineState, EngineStatus, ThermalOverride, ThermalSettings
from fleet.selectors import engines_desired, fleet_overview, routing_snapshot
from fleet.services import engine_state_record
from tests.factories import EngineSpecFactory, ModelConfigFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("status", "up"),
    [
        (EngineStatus.READY, True),
        (EngineStatus.LOADING, True),
        (EngineStatus.COOLING, True),
        (EngineStatus.UNHEALTHY, False),
        (EngineStatus.STOPPING, False),
        (EngineStatus.STARTING, False),
        (EngineStatus.CRASHED, False),
        (EngineStatus.STOPPED, False),
    ],
)
def test_routing_sends_requests_only_to_engines_that_serve(status, up):
    """An unhealthy engine (being replaced) or one draining to stop is down for
    routing, like a crashed one, though its heartbeat is fresh."""
    spec = EngineSpecFactory(name="e1")
    EngineState.objects.create(spec=spec, status=status, heartbeat_at=timezone.now())
    assert routing_snapshot().engines["e1"].up is up


def test_heartbeats_are_aged_by_the_database_clock_not_a_hosts(monkeypatch):
    """The supervisor stamps heartbeats with the database's clock (Now()) and
    routing ages them by it: with this host's clock an hour off, a fresh
    heartbeat is still fresh, and the dashboard's age is seconds. Control: the
    same heartbeat stamped with the skewed host clock (as a node without NTP
    would have) is taken for stale, the engine for down."""
    spec = EngineSpecFactory(name="e1")
    engine_state_record(spec_id=spec.pk, status=EngineStatus.READY, heartbeat_at=Now())
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(hours=1))
    assert routing_snapshot().engines["e1"].up
    [engine] = [item for item in fleet_overview()["engines"] if item["name"] == "e1"]
    assert 0 <= engine["heartbeat_age_s"] < 60

    engine_state_record(spec_id=spec.pk, heartbeat_at=timezone.now())  # control
    assert not routing_snapshot().engines["e1"].up


def test_the_configuration_the_supervisor_writes_is_what_the_engine_reads():
    """Built through engines/launch/config.py's schemas from the rows (catalog
    models with their measured memory, sampling and template, limits, thermal
    overrides, devices, cores), it reads back unchanged with the engine's
    strict reader."""
    spec = EngineSpecFactory(name="gpu9", backend="cuda", devices="GPU-1", cpus="0-1")
    ModelConfigFactory(
        name="chatty",
        format="gguf",
        sampling={"temperature": 0.3},
        chat_template="{{ messages }}",
        measured_memory_mib=300,
    )
    ThermalOverride.objects.create(
        settings=ThermalSettings.load(), vendor="amd", high=95, resume=92
    )
    [desired] = [item for item in engines_desired() if item.spec_id == spec.pk]
    config = desired.config
    assert isinstance(config, EngineConfig)
    assert config.models["chatty"].sampling == {"temperature": 0.3}
    assert config.models["chatty"].measured_mib == 300
    assert config.thermal.overrides == {"amd": VendorThresholds(high=95, resume=92)}
    assert (config.devices, config.cpus) == (["GPU-1"], [0, 1])
    assert EngineConfig.from_dict(json.loads(desired.config_key)) == config


def test_state_of_a_deleted_engine_is_not_recorded():
    """The supervisor may record an engine whose spec was just deleted: nothing
    is written and nothing fails; a live spec's state is created, then updated."""
    spec = EngineSpecFactory(name="short-lived")
    engine_state_record(spec_id=spec.pk, status=EngineStatus.STARTING, pid=12)
    engine_state_record(spec_id=spec.pk, status=EngineStatus.READY)
    state = EngineState.objects.get(spec=spec)
    assert (state.status, state.pid) == (EngineStatus.READY, 12)
    spec_id = spec.pk
    spec.delete()
    engine_state_record(spec_id=spec_id, status=EngineStatus.READY)
    assert not EngineState.objects.filter(spec_id=spec_id).exists()


def test_an_engines_incarnation_is_its_recorded_start():
    """Routing tells a restarted engine from its last start (whose prompt
    cache it no longer has) by the start the supervisor recorded."""
    spec = EngineSpecFactory(name="e1")
    engine_state_record(spec_id=spec.pk, status=EngineStatus.READY, heartbeat_at=Now())
    assert routing_snapshot().engines["e1"].incarnation == ""
    engine_state_record(spec_id=spec.pk, started_at=Now())
    first = routing_snapshot().engines["e1"].incarnation
    engine_state_record(spec_id=spec.pk, started_at=timezone.now() + timedelta(1))
    assert "" != first != routing_snapshot().engines["e1"].incarnation


def test_a_replica_placed_on_an_engine_is_kept_loaded_there():
    """On a node, the configuration of an engine a model's replica is placed
    on keeps that model loaded (keep-alive 0: the supervisor loads placed
    replicas, and the idle unload must not undo that and reload it); the
    node's other engine, where the model is not placed, keeps the model's own
    keep-alive (a load there is a fallback, unloaded when idle). Control: a
    one-host platform's engine keeps the model's keep-alive."""
    from cluster.models import Node

    node = Node.objects.create(
        name="n1",
        address="10.0.0.1",
        joined_at=timezone.now(),
        last_heartbeat=timezone.now(),
    )
    placed = EngineSpecFactory(name="e1", capabilities=["gguf"], node=node, order=1)
    other = EngineSpecFactory(name="e2", capabilities=["gguf"], node=node, order=2)
    alone = EngineSpecFactory(name="e0", capabilities=["gguf"], order=0)
    ModelConfigFactory(name="kept", engine_pin="e1", keep_alive_s=300)
    on_node = {item.spec_id: item.config for item in engines_desired(node="n1")}
    assert on_node[placed.pk].models["kept"].keep_alive_s == 0
    assert on_node[other.pk].models["kept"].keep_alive_s == 300
    one_host = {item.spec_id: item.config for item in engines_desired()}
    assert one_host[alone.pk].models["kept"].keep_alive_s == 300
