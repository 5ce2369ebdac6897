"""Per-key limits: requests per minute and concurrent requests, in the cache."""

import asyncio
import contextlib
import threading

import pytest
import redis
from django.core.cache import cache
from django.test import override_settings

from api import limits
from api.limits import LimitExceeded, key_admission
from api.models import ApiKey
from tests.conftest import run_python

REDIS_URL = "redis://127.0.0.1:6379/3"
REDIS_CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
    }
}


def key_with(*, pk: int = 1, rpm_limit: int = 0, max_concurrent: int = 0) -> ApiKey:
    """A key as the views hold it; the limits read only its id and limits."""
    return ApiKey(pk=pk, rpm_limit=rpm_limit, max_concurrent=max_concurrent)


async def settled() -> None:
    """Wait until every other task (a give-back left running) has finished."""
    while others := asyncio.all_tasks() - {asyncio.current_task()}:
        await asyncio.gather(*others, return_exceptions=True)


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


async def test_rpm_limit(clock):
    """Over the requests per minute: LimitExceeded with the seconds to the next
    minute (1..60); the next minute admits again."""
    await rpm_is_enforced(clock)


async def test_unlimited_key_is_always_admitted(clock):
    """0 means unlimited for both limits."""
    key = key_with()
    async with contextlib.AsyncExitStack() as held:
        for _ in range(50):
            await held.enter_async_context(key_admission(key))


async def test_concurrency_limit():
    """Over max concurrent: LimitExceeded (retry after 1 s) that holds no slot."""
    await concurrency_is_enforced()


async def test_slot_is_released_when_the_body_raises():
    """A request that fails gives its slot back."""
    key = key_with(max_concurrent=1)
    with pytest.raises(RuntimeError):
        async with key_admission(key):
            raise RuntimeError("engine failed")
    await admit(key)


async def test_slot_is_released_when_the_request_is_cancelled():
    """A request cancelled while admitted (client went away) gives its slot back."""
    key = key_with(max_concurrent=1)
    inside, forever = asyncio.Event(), asyncio.Event()

    async def request() -> None:
        async with key_admission(key):
            inside.set()
            await forever.wait()

    task = asyncio.create_task(request())
    await inside.wait()
    with pytest.raises(LimitExceeded):
        await admit(key)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await admit(key)


class GatedCache:
    """The real cache, whose first incr waits until the test lets it go on."""

    def __init__(self, real) -> None:
        self.real = real
        self.entered, self.proceed = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def incr(self, *args, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            self.proceed.wait(timeout=30)
        return self.real.incr(*args, **kwargs)


async def test_in_process_cache_is_counted_on_the_event_loop(monkeypatch):
    """With the in-process cache, admission takes no thread hop."""

    def no_thread(**kwargs):
        raise AssertionError("the in-process cache was counted in a thread")

    monkeypatch.setattr(limits, "_admit_async", no_thread)
    monkeypatch.setattr(limits, "_slot_give_back_async", no_thread)
    key = key_with(rpm_limit=5, max_concurrent=1)
    await admit(key)
    await admit(key)


async def test_slot_is_released_when_cancelled_while_being_taken(monkeypatch):
    """A request cancelled while its slot is being counted (the increment runs on
    in its thread, as it does for a cache in another process) does not leak the
    slot."""
    key = key_with(max_concurrent=1)
    gated = GatedCache(cache)
    monkeypatch.setattr(limits, "cache", gated)
    monkeypatch.setattr(limits, "_in_process", lambda: False)

    async def request() -> None:
        async with key_admission(key):
            raise AssertionError("the cancelled request must not run")

    task = asyncio.create_task(request())
    try:
        assert await asyncio.to_thread(gated.entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        gated.proceed.set()
    await settled()
    assert not limits._releasing
    await admit(key)


async def test_slot_is_released_once():
    """Leaving gives back one slot: the counter returns to zero, never below."""
    key = key_with(max_concurrent=3)
    for _ in range(5):
        await admit(key)
    epoch = int(limits.time.time()) // limits.CONCURRENCY_EPOCH_S
    assert cache.get(f"cc:{key.pk}:{epoch}") == 0


async def test_requests_from_the_previous_epoch_still_count(clock):
    """A request admitted just before a new epoch keeps its slot after it."""
    key = key_with(max_concurrent=1)
    clock.now = 1_800_000_000.0 + limits.CONCURRENCY_EPOCH_S - 1
    async with key_admission(key):
        clock.now += 2
        with pytest.raises(LimitExceeded):
            await admit(key)
    await admit(key)


async def test_leaked_slot_is_forgotten_after_two_epochs(clock):
    """A slot never given back (its process died) stops counting two epochs on."""
    key = key_with(max_concurrent=1)
    admission = key_admission(key)
    await admission.__aenter__()  # and never leaves, as in a killed process
    clock.now += limits.CONCURRENCY_EPOCH_S
    with pytest.raises(LimitExceeded):
        await admit(key)
    clock.now += limits.CONCURRENCY_EPOCH_S
    await admit(key)


@pytest.fixture
def redis_cache():
    """Django's cache on the real Redis (db 3), emptied before and after."""
    with override_settings(CACHES=REDIS_CACHES):
        cache.clear()
        yield cache
        cache.clear()


async def test_limits_on_redis(redis_cache, clock):
    """On Redis the same limits hold, and their counters live in Redis."""
    await rpm_is_enforced(clock)
    await concurrency_is_enforced()
    client = redis.Redis.from_url(REDIS_URL)
    stored = {name.decode() for name in client.keys("*")}
    assert any(":rl:1:" in name for name in stored)
    assert any(":cc:1:" in name for name in stored)
    assert all(0 < client.ttl(name) <= limits.CONCURRENCY_TTL_S for name in stored)


async def test_front_processes_share_the_concurrency_limit(redis_cache):
    """A slot held here is seen by another front process using the same Redis."""
    other_front = """
import asyncio, django
django.setup()
from api.limits import LimitExceeded, key_admission
from api.models import ApiKey

async def main():
    try:
        async with key_admission(ApiKey(pk=1, max_concurrent=1)):
            print("admitted")
    except LimitExceeded:
        print("refused")

asyncio.run(main())
"""
    env = {"DJANGO_SETTINGS_MODULE": "roundhouse.settings", "REDIS_URL": REDIS_URL}
    key = key_with(max_concurrent=1)
    async with key_admission(key):
        held = await asyncio.to_thread(run_python, other_front, env=env)
    assert held.returncode == 0, held.stderr
    assert held.stdout.strip() == "refused"
    freed = await asyncio.to_thread(run_python, other_front, env=env)
    assert freed.stdout.strip() == "admitted", freed.stderr


# -- the failed-key throttle ---------------------------------------------------


def throttle(**overrides) -> limits.FailureThrottle:
    """A throttle of 3 failures a minute, on a clock at `throttle.now`."""
    made = limits.FailureThrottle(**{"limit": 3, "window_s": 60.0, **overrides})
    made.now = 0.0
    made.clock = lambda: made.now
    return made


def test_throttle_refuses_a_client_over_its_failures_until_its_window_ends():
    """The limit-th failure in a window refuses the client for the rest of the
    window (Retry-After: the seconds left, rounded up); other clients are free."""
    gate = throttle()
    for _ in range(3):
        gate.check("a")
        gate.failed("a")
    gate.now = 20.5
    with pytest.raises(LimitExceeded) as over:
        gate.check("a")
    assert (over.value.retry_after_s, over.value.code) == (40, "too_many_invalid_keys")
    gate.check("b")
    gate.now = 60.0
    gate.check("a")
    assert len(gate) == 0  # the expired window is forgotten


def test_throttle_counts_failures_per_window():
    """Failures in an earlier window do not count in the next."""
    gate = throttle()
    gate.failed("a")
    gate.failed("a")
    gate.now = 61.0
    gate.failed("a")
    gate.failed("a")
    gate.check("a")
    gate.failed("a")
    with pytest.raises(LimitExceeded):
        gate.check("a")


def test_throttle_memory_is_bounded():
    """At most max_clients are tracked; the one that failed least recently goes."""
    gate = throttle(max_clients=3)
    for client in ("a", "b", "c"):
        for _ in range(3):
            gate.failed(client)
    gate.failed("a")  # a is now the most recent
    gate.failed("d")
    assert len(gate) == 3
    gate.check("b")  # forgotten: free
    for client in ("a", "c"):
        with pytest.raises(LimitExceeded):
            gate.check(client)


def test_a_lookup_that_succeeds_is_taken_back():
    """Lookups count as failures while in flight; one that succeeded does not."""
    gate = throttle()
    for _ in range(3):
        gate.failed("a")
    with pytest.raises(LimitExceeded):
        gate.check("a")
    gate.take_back("a")
    gate.check("a")


async def test_weight_counts_against_concurrency():
    """A request with n choices takes n of its caller's concurrency: with 4
    allowed, one of weight 3 leaves room for one of weight 1, not 2; one
    heavier than the whole allowance is refused as TooHeavy (it could never
    run); what was taken is given back whole (control: after both leave, 4
    of weight 1 fit again)."""
    allowance = limits.Allowance("w1", 0, 4, who="your account")
    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(limits.admission(allowance, weight=3))
        with pytest.raises(LimitExceeded, match="your account: at most 4"):
            async with limits.admission(allowance, weight=2):
                pass
        await held.enter_async_context(limits.admission(allowance, weight=1))
    with pytest.raises(limits.TooHeavy, match="opens 5 engine requests"):
        async with limits.admission(allowance, weight=5):
            pass
    async with contextlib.AsyncExitStack() as held:
        for _ in range(4):
            await held.enter_async_context(limits.admission(allowance))
        with pytest.raises(LimitExceeded):
            async with limits.admission(allowance):
                pass


async def test_batch_budget_is_apart_from_live_requests():
    """A key's batch lines count in their own budget (the key's numbers):
    a key whose live concurrency is full still admits a batch line, and the
    other way round."""
    key = key_with(pk=7, max_concurrent=1)
    async with key_admission(key):
        with pytest.raises(LimitExceeded):
            await admit(key)
        async with limits.admission(limits.Allowance.of_key_batches(key)):
            with pytest.raises(LimitExceeded, match="this API key's batches"):
                async with limits.admission(limits.Allowance.of_key_batches(key)):
                    pass
