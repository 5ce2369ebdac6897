"""API tests start with empty limit counters and a clock the test can set."""

import types

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.db import connections

from api import limits


@pytest.fixture(autouse=True)
def empty_cache():
    """Counters of an earlier test (same key ids) must not leak into this one."""
    cache.clear()
    yield
    cache.clear()


@pytest.fixture(autouse=True)
async def close_worker_connections():
    """Close the connections async tests opened in asgiref's worker thread: left
    open, PostgreSQL refuses to drop the test database at the end of the run."""
    yield
    await sync_to_async(connections.close_all)()


@pytest.fixture
def clock(monkeypatch) -> types.SimpleNamespace:
    """The limits' clock, fixed at `clock.now` (seconds since the epoch)."""
    fake = types.SimpleNamespace(now=1_800_000_000.0)
    fake.time = lambda: fake.now
    monkeypatch.setattr(limits, "time", fake)
    return fake
