"""The micro-batcher in isolation, with a model function we control."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engines.runtime.batching import MicroBatcher
from engines.wire.errors import ProtocolError
from tests.waiting import await_for, suspended_in


def fake_encoder(calls: list[list[str]], poison: str = "POISON"):
    """Encodes text i as the row [len(text), hash]; raises on a poison text."""

    def encode(texts: list[str]) -> np.ndarray:
        calls.append(list(texts))
        if poison in texts:
            raise ValueError("poisoned batch")
        return np.array([[len(t), sum(map(ord, t))] for t in texts], dtype=np.float32)

    return encode


def expected_rows(texts):
    return np.array([[len(t), sum(map(ord, t))] for t in texts], dtype=np.float32)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


async def test_callers_share_a_batch_and_get_their_own_rows(executor):
    """Requests arriving within the window run as one call, sliced back in order."""
    calls: list[list[str]] = []
    batcher = MicroBatcher(
        fake_encoder(calls), executor=executor, window_s=0.05, max_batch_size=100
    )
    requests = [[f"text {i}"] * (i % 3 + 1) for i in range(20)]
    results = await asyncio.gather(*(batcher.submit(r) for r in requests))
    assert len(calls) == 1 and len(calls[0]) == sum(map(len, requests))
    for request, rows in zip(requests, results, strict=True):
        np.testing.assert_array_equal(rows, expected_rows(request))
    await batcher.close()


async def test_max_batch_size_splits_batches_in_arrival_order(executor):
    """No batch exceeds the max size (unless one request alone is bigger)."""
    calls: list[list[str]] = []
    batcher = MicroBatcher(
        fake_encoder(calls), executor=executor, window_s=0.02, max_batch_size=4
    )
    requests = [["a", "b"], ["c", "d"], ["e"], ["f", "g", "h", "i", "j"], ["k"]]
    await asyncio.gather(*(batcher.submit(r) for r in requests))
    assert calls == [["a", "b", "c", "d"], ["e"], ["f", "g", "h", "i", "j"], ["k"]]
    await batcher.close()


async def test_a_failing_batch_fails_only_its_own_callers(executor):
    """The poisoned batch's callers get `internal`; the next batch succeeds."""
    calls: list[list[str]] = []
    batcher = MicroBatcher(
        fake_encoder(calls), executor=executor, window_s=0.02, max_batch_size=2
    )
    results = await asyncio.gather(
        batcher.submit(["ok1"]),
        batcher.submit(["POISON"]),
        batcher.submit(["ok2"]),
        batcher.submit(["ok3"]),
        return_exceptions=True,
    )
    assert isinstance(results[0], ProtocolError) and results[0].code == "internal"
    assert isinstance(results[1], ProtocolError)
    np.testing.assert_array_equal(results[2], expected_rows(["ok2"]))
    np.testing.assert_array_equal(results[3], expected_rows(["ok3"]))
    await batcher.close()


async def test_row_count_mismatch_fails_the_batch(executor):
    """A model returning the wrong number of rows is an error, not a mis-slice."""
    batcher = MicroBatcher(
        lambda texts: np.zeros((len(texts) - 1, 2), dtype=np.float32),
        executor=executor,
        window_s=0,
        max_batch_size=8,
    )
    with pytest.raises(ProtocolError, match="1 rows for 2"):
        await batcher.submit(["a", "b"])
    await batcher.close()


async def test_requests_past_the_queue_timeout_are_overloaded(executor):
    """A request that waited longer than the queue timeout is refused, not run."""
    calls: list[list[str]] = []
    batcher = MicroBatcher(
        fake_encoder(calls),
        executor=executor,
        window_s=0.05,
        max_batch_size=8,
        queue_timeout_s=0.01,
    )
    with pytest.raises(ProtocolError) as error:
        await batcher.submit(["late"])
    assert error.value.code == "overloaded"
    assert calls == []
    await batcher.close()


async def test_idle_loop_sleeps_on_its_event(executor):
    """With nothing queued the loop is parked on its wake-up event (cleared),
    not polling: its task waits in `Event.wait` until the next request."""
    calls: list[list[str]] = []
    batcher = MicroBatcher(
        fake_encoder(calls), executor=executor, window_s=0, max_batch_size=8
    )
    await batcher.submit(["one"])
    await await_for(
        lambda: suspended_in(batcher._task) == ["_loop", "wait"], what="the loop parked"
    )
    assert not batcher._wakeup.is_set()
    await batcher.submit(["two"])  # the event wakes it
    assert calls == [["one"], ["two"]]
    await batcher.close()


async def test_a_loop_with_a_request_waits_out_its_window(executor):
    """The control of the test above: with a request in its window, the loop
    sleeps out the window, not parked on the event (which is set)."""
    batcher = MicroBatcher(
        fake_encoder([]), executor=executor, window_s=60, max_batch_size=8
    )
    pending = asyncio.ensure_future(batcher.submit(["waits"]))
    await await_for(
        lambda: batcher._task and suspended_in(batcher._task) == ["_loop", "sleep"],
        what="the loop in its window",
    )
    assert batcher._wakeup.is_set()
    await batcher.close()
    with pytest.raises(ProtocolError):
        await pending


async def test_close_cancels_queued_requests(executor):
    """Requests still queued when the batcher closes are told `cancelled`."""
    batcher = MicroBatcher(
        fake_encoder([]), executor=executor, window_s=10, max_batch_size=8
    )
    pending = asyncio.create_task(batcher.submit(["never"]))
    await await_for(lambda: batcher.queued_requests == 1, what="the request queued")
    await batcher.close()
    with pytest.raises(ProtocolError) as error:
        await pending
    assert error.value.code == "cancelled"
