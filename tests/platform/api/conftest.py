"""API tests start with empty limit counters and a clock the test can set; the
limits on the real Redis, and a real outage of the database, for the tests
that ask."""

import types

import pytest
import redis
from asgiref.sync import sync_to_async
from django.db import connection, connections

from api import counters
from api.gateway import front_gateway
from fleet.outages import OutageClock
from tests.platform.api.clean_slate import close_background_connections, front_forget
from tests.platform.api.limit_checks import REDIS_URL
from tests.platform.api.outage import Outage


@pytest.fixture(autouse=True)
def empty_cache():
    """Counters, remembered and refused keys, throttled clients, users'
    remembered limits and a database outage of an earlier test (same key
    ids, same hashes after a flush, the test client's one address; the
    gateway's failed fleet reads) must not leak into this one."""
    front_forget()
    yield
    front_forget()


@pytest.fixture(autouse=True)
async def close_worker_connections():
    """Close the connections tests opened in other threads (asgiref's worker,
    the usage writer, the snapshot loader): left open, PostgreSQL refuses to
    drop the test database at the end of the run."""
    yield
    await sync_to_async(connections.close_all)()
    close_background_connections()


@pytest.fixture
def clock(monkeypatch) -> types.SimpleNamespace:
    """The limits' clock in this process (what counts windows without Redis),
    fixed at `clock.now` (seconds since the epoch)."""
    fake = types.SimpleNamespace(now=1_800_000_000.0)
    fake.time = lambda: fake.now
    monkeypatch.setattr(counters, "time", fake)
    return fake


@pytest.fixture
def redis_limits(settings):
    """The limits on the real Redis (db 3), emptied before and after."""
    settings.REDIS_URL = REDIS_URL
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture(params=["unreachable", "refusing"])
def outage(request, transactional_db, tmp_path, monkeypatch):
    """An outage the test starts (ended at teardown if the test did not). The
    gateway forgets it afterwards: no other test's routing sees its grace."""
    if request.param == "refusing" and connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's ALLOW_CONNECTIONS")
    monkeypatch.setattr(front_gateway(), "outages", OutageClock())
    outage = Outage(request.param, tmp_path)
    yield outage
    if outage.saved or outage.kind == "refusing":
        outage.end()
