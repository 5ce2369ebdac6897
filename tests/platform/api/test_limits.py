"""Per-key limits: requests per minute and concurrent requests, counted in
this process or in Redis (tests/platform/api/test_limits_redis.py: Redis
unavailable, leases, one clock)."""

import asyncio
import contextlib

import pytest

from api import counters, limits
from api.limits import LimitExceeded, key_admission
from tests.conftest import run_python
from tests.platform.api.limit_checks import (
    REDIS_URL,
    GatedRedis,
    admit,
    concurrency_is_enforced,
    key_with,
    rpm_is_enforced,
)
from tests.waiting import await_for


async def settled() -> None:
    """Wait until every other task (a give-back left running) has finished."""
    while others := asyncio.all_tasks() - {asyncio.current_task()}:
        await asyncio.gather(*others, return_exceptions=True)


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


async def test_counting_in_this_process_takes_no_thread_hop(monkeypatch):
    """Without Redis, admission counts on the event loop."""

    def no_thread(*args, **kwargs):
        raise AssertionError("counting in this process went to a thread")

    monkeypatch.setattr(limits, "_admit_async", no_thread)
    monkeypatch.setattr(limits, "_give_back_async", no_thread)
    key = key_with(rpm_limit=5, max_concurrent=1)
    await admit(key)
    await admit(key)


async def test_slot_is_released_when_cancelled_while_being_taken(
    redis_limits, monkeypatch
):
    """A request cancelled while its lease is being taken in Redis (the taking
    runs on in its thread) does not leak the lease."""
    key = key_with(max_concurrent=1)
    gated = GatedRedis(monkeypatch)

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
    """Leaving gives back one slot: the count returns to zero, never below."""
    key = key_with(max_concurrent=3)
    for _ in range(5):
        await admit(key)
    assert counters.counters().local.held(str(key.pk)) == 0


async def rpm_is_enforced_by_redis() -> None:
    """The rate limit, by Redis's clock (which the test cannot set)."""
    key = key_with(rpm_limit=3)
    for _ in range(3):
        await admit(key)
    with pytest.raises(LimitExceeded, match="3 requests per minute") as over:
        await admit(key)
    assert 1 <= over.value.retry_after_s <= 60


async def test_limits_on_redis(redis_limits):
    """On Redis the same limits hold, and their counts live in Redis, each
    with a TTL: a window's for two windows, a lease's for its term."""
    await rpm_is_enforced_by_redis()
    await concurrency_is_enforced()
    assert counters.counters().mode() == "shared"
    async with key_admission(key_with(max_concurrent=1)):
        stored = {name.decode() for name in redis_limits.keys("*")}
        assert stored == {"roundhouse:limits:rl:1", "roundhouse:limits:cc:1"}
        assert 0 < redis_limits.ttl("roundhouse:limits:rl:1") <= 120
        assert 0 < redis_limits.ttl("roundhouse:limits:cc:1") <= counters.LEASE_S + 1
        assert redis_limits.zcard("roundhouse:limits:cc:1") == 1
    assert redis_limits.zcard("roundhouse:limits:cc:1") == 0


async def test_front_processes_share_the_concurrency_limit(redis_limits):
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


async def _until_waiting(gate: limits.FailureThrottle, client: str) -> None:
    """Until a lookup of `client` waits for a slot (a state, not a time)."""
    await await_for(
        lambda: gate._waiting.get(client), what=f"a lookup of {client} waiting"
    )


async def test_lookups_in_flight_wait_for_the_failures_left():
    """A client has at most as many lookups in flight as failures left in its
    window: the next waits (it is not refused); a lookup that ends without
    failing lets it go on; once failures use up the window, the waiting ones
    are refused. Other clients are not held up."""
    gate = throttle()  # 3 failures a minute
    for _ in range(3):
        await gate.lookup_slot("a")
    waiting = asyncio.ensure_future(gate.lookup_slot("a"))
    await _until_waiting(gate, "a")
    await gate.lookup_slot("b")
    gate.lookup_done("a")  # found its key: no failure
    await waiting
    assert not gate._waiting

    refused = asyncio.ensure_future(gate.lookup_slot("a"))
    await _until_waiting(gate, "a")
    for _ in range(3):  # the three in flight fail
        gate.failed("a")
        gate.lookup_done("a")
    with pytest.raises(LimitExceeded):
        await refused
    assert not gate._waiting


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
