"""A real cluster on one machine: hosts in network namespaces (tests/cluster/
netns.py), each running `manage.py supervise --node NAME` (which joins with
the admin's one-time token, heartbeats, runs the node's relay and its
engine) and a front, all on the test database (PostgreSQL, reached through
the bridge) and a Redis database of their own. The set-up itself and the
clients the tests use: tests/cluster/cluster_setup.py.

Runs where the test database is PostgreSQL and the tests run as root (CI's
PostgreSQL pass); skipped on SQLite; where namespaces cannot be made they are
skipped too, unless ROUNDHOUSE_REQUIRE_NETNS=1 (set by .ci/run) makes that a
failure."""

import os

import pytest
from django.db import connection

from tests.cluster.cluster_setup import open_cluster, wait_resident
from tests.cluster.netns import netns_available
from tests.platform.live import live_database


@pytest.fixture(scope="module")
def cluster_database(django_db_setup, django_db_blocker):
    if connection.vendor != "postgresql":
        pytest.skip(
            "cluster tests need PostgreSQL (DATABASE_URL=postgres://...; .ci/run's "
            "second pass)"
        )
    why = netns_available()
    if why is not None:
        if os.environ.get("ROUNDHOUSE_REQUIRE_NETNS") == "1":
            pytest.fail(f"multi-host tests cannot run: {why}")
        pytest.skip(why)
    with live_database(django_db_blocker):
        yield


@pytest.fixture
def orm(django_db_blocker):
    with django_db_blocker.unblock():
        yield


@pytest.fixture(scope="module")
def cluster(cluster_database, django_db_blocker, tmp_path_factory):
    """Nodes a (label zone-a) and b (zone-b), an engine each; `smol` placed on
    both, `smol-b` on b; started and ready."""
    tmp = tmp_path_factory.mktemp("cluster")
    with open_cluster(tmp, django_db_blocker) as built:
        with django_db_blocker.unblock():
            built.add_node("a", labels=["zone-a", "spare"])
            built.add_node("b", labels=["zone-b", "spare"])
            wait_resident("smol", {"ea", "eb"})
            wait_resident("smol-b", {"eb"})
        yield built
