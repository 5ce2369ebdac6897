"""tests/waiting.py: the one helper tests wait with."""

import asyncio

import pytest

from tests.waiting import await_for, wait_for


def countdown(calls: int, value):
    """A predicate false for `calls - 1` calls, then `value`; counts its calls."""
    seen = []

    def predicate():
        seen.append(1)
        return value if len(seen) >= calls else 0

    return predicate, seen


def test_wait_for_returns_the_first_true_value():
    """Polled until true: the value it returned then, after as many calls."""
    predicate, seen = countdown(3, {"ready": True})
    assert wait_for(predicate, interval=0) == {"ready": True}
    assert len(seen) == 3


def test_wait_for_fails_naming_what_and_the_last_value():
    """At the deadline: an AssertionError with `what` and the last value seen
    (the control of the test above: a predicate that never holds)."""
    with pytest.raises(AssertionError) as error:
        wait_for(lambda: [], timeout=0, what="the queue to fill")
    assert "waiting for the queue to fill" in str(error.value)
    assert "last value: []" in str(error.value)


async def test_await_for_awaits_what_the_predicate_returns():
    """A predicate returning an awaitable (a blocking check run in a thread)
    is awaited for its value; a plain value is taken as it is."""
    predicate, seen = countdown(2, "done")
    assert await await_for(lambda: asyncio.to_thread(predicate), interval=0) == "done"
    assert len(seen) == 2
    assert await await_for(lambda: 7) == 7


async def test_await_for_fails_like_wait_for():
    """At the deadline the async twin fails the same way, naming what and the
    last value."""

    async def never():
        return None

    with pytest.raises(AssertionError, match="waiting for nothing.*last value: None"):
        await await_for(never, timeout=0, what="nothing")
