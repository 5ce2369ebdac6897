"""Waiting for a state in tests: poll a predicate until it returns something
true, or fail at a deadline naming what never came and the last value seen.

The one place tests wait for something to happen. A test that checks that
something did *not* happen waits for a state that proves it had its chance
(a later request answered, a reading taken), never for a while."""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Generous: a deadline only bounds how long a failing test takes to fail.
TIMEOUT_S = 120.0
INTERVAL_S = 0.05


def wait_for(
    predicate: Callable[[], T],
    *,
    timeout: float = TIMEOUT_S,
    interval: float = INTERVAL_S,
    what: str = "the condition",
) -> T:
    """Call `predicate` until it returns something true, and return that; an
    AssertionError with `what` and the last value once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout, value))
        time.sleep(interval)


async def await_for(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = TIMEOUT_S,
    interval: float = INTERVAL_S,
    what: str = "the condition",
) -> T:
    """`wait_for` on the event loop: the predicate may return an awaitable
    (a coroutine function's call, or `asyncio.to_thread(...)` for a blocking
    check), which is awaited for its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout, value))
        await asyncio.sleep(interval)


def suspended_in(task: asyncio.Task) -> list[str]:
    """The coroutines a pending task is suspended in, outermost first (its own,
    then what each awaits): the state a test waits for to know that a task has
    run up to a given await, without a sleep. Empty once the task is done."""
    names: list[str] = []
    if task.done():
        return names
    awaited: Any = task.get_coro()
    while hasattr(awaited, "cr_code"):
        names.append(awaited.cr_code.co_name)
        awaited = awaited.cr_await
    return names


def _timed_out(what: str, timeout: float, value: Any) -> str:
    return f"timed out after {timeout:g} s waiting for {what} (last value: {value!r})"
