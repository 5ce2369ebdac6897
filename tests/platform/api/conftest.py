"""API tests start with empty limit counters and a clock the test can set."""

import types

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.db import connections

from api import limits, selectors, services, usage
from api.gateway import GATEWAY


def forget_keys() -> None:
    services._recent_keys.clear()
    services._stale_keys.clear()
    services._refused_keys.clear()
    services.AUTH_FAILURES.clear()
    services.DATABASE_OUTAGE.down = False
    services.DATABASE_OUTAGE.failed_at = -float("inf")
    selectors.user_allowances_forget()


@pytest.fixture(autouse=True)
def empty_cache():
    """Counters, remembered and refused keys, throttled clients, users'
    remembered limits and a database outage of an earlier test (same key
    ids, same hashes after a flush, the test client's one address) must not
    leak into this one."""
    cache.clear()
    forget_keys()
    yield
    cache.clear()
    forget_keys()


@pytest.fixture(autouse=True)
async def close_worker_connections():
    """Close the connections tests opened in other threads (asgiref's worker,
    the usage writer, the snapshot loader): left open, PostgreSQL refuses to
    drop the test database at the end of the run."""
    yield
    await sync_to_async(connections.close_all)()
    close_background_connections()


def close_background_connections() -> None:
    """Close the usage writer's and the snapshot loader's connections."""
    usage.USAGE_WRITER.close()
    GATEWAY.close()


@pytest.fixture
def clock(monkeypatch) -> types.SimpleNamespace:
    """The limits' clock, fixed at `clock.now` (seconds since the epoch)."""
    fake = types.SimpleNamespace(now=1_800_000_000.0)
    fake.time = lambda: fake.now
    monkeypatch.setattr(limits, "time", fake)
    return fake
