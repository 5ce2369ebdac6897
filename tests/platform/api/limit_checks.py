"""Per-key limits as the limit tests check them, in this process and in Redis: a
key with limits, one admission, the rate and concurrency checks both run, and
a Redis whose first lease waits for the test."""

import contextlib
import threading

import pytest

from api import counters
from api.limits import LimitExceeded, key_admission
from api.models import ApiKey

REDIS_URL = "redis://127.0.0.1:6379/3"


def key_with(*, pk: int = 1, rpm_limit: int = 0, max_concurrent: int = 0) -> ApiKey:
    """A key as the views hold it; the limits read only its id and limits."""
    return ApiKey(pk=pk, rpm_limit=rpm_limit, max_concurrent=max_concurrent)


async def admit(key: ApiKey) -> None:
    """One request that is admitted and leaves at once."""
    async with key_admission(key):
        pass


async def rpm_is_enforced(clock) -> None:
    clock.now = 1_800_000_015.0  # 15 s into a minute (1_800_000_000 % 60 == 0)
    key = key_with(rpm_limit=3)
    for _ in range(3):
        await admit(key)
    with pytest.raises(LimitExceeded, match="3 requests per minute") as over:
        await admit(key)
    assert over.value.retry_after_s == 45
    assert over.value.code == "rate_limit_exceeded"

    clock.now = 1_800_000_059.9
    with pytest.raises(LimitExceeded) as over:
        await admit(key)
    assert over.value.retry_after_s == 1

    clock.now = 1_800_000_060.0  # the next minute
    for _ in range(3):
        await admit(key)
    with pytest.raises(LimitExceeded) as over:
        await admit(key)
    assert 1 <= over.value.retry_after_s <= 60
    await admit(key_with(pk=2, rpm_limit=3))  # another key has its own count


async def concurrency_is_enforced() -> None:
    key = key_with(max_concurrent=2)
    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(key_admission(key))
        await held.enter_async_context(key_admission(key))
        for _ in range(3):
            with pytest.raises(LimitExceeded, match="at most 2 at once") as over:
                await admit(key)
            assert over.value.retry_after_s == 1
            assert over.value.code == "concurrency_limit_exceeded"
        await admit(key_with(pk=2, max_concurrent=1))  # another key is free
    # Refused requests took nothing: both slots are free again.
    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(key_admission(key))
        await held.enter_async_context(key_admission(key))


class GatedRedis:
    """Redis's take of a lease, whose first call waits until the test lets it
    go on (installed on the class: every process-wide counters use it)."""

    def __init__(self, monkeypatch) -> None:
        self.entered, self.proceed = threading.Event(), threading.Event()
        real = counters.RedisCounters.take

        def take(shared, *args, **kwargs):
            if not self.entered.is_set():
                self.entered.set()
                self.proceed.wait(timeout=30)
            return real(shared, *args, **kwargs)

        monkeypatch.setattr(counters.RedisCounters, "take", take)
