"""Handoff (engines/generation/handoff.py): what the decode thread emits
during a pass reaches the event loop in one hand-over when the pass ends, in
order; from another thread, or outside a pass, at once. A real event loop in
its own thread; the hand-overs are counted on the way to its
call_soon_threadsafe."""

import asyncio
import threading

import pytest

from engines.generation.handoff import Handoff


class CountingLoop:
    """A running event loop's call_soon_threadsafe, counted."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread_id: int) -> None:
        self.loop = loop
        self.thread_id = thread_id
        self.handovers = 0

    def call_soon_threadsafe(self, callback, arg) -> None:
        self.handovers += 1
        self.loop.call_soon_threadsafe(callback, arg)


@pytest.fixture
def loop():
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    yield CountingLoop(running, thread.ident)
    running.call_soon_threadsafe(running.stop)
    thread.join(10)
    running.close()


def drained(loop: CountingLoop) -> threading.Event:
    """An event set once the loop has run everything handed to it so far."""
    done = threading.Event()
    loop.loop.call_soon_threadsafe(done.set)
    return done


def test_a_pass_hands_its_events_over_once_in_order(loop):
    handoff, received = Handoff(), []
    threads: set[int] = set()

    def arrived(event):
        threads.add(threading.get_ident())
        received.append(event)

    with handoff.holding():
        for number in range(32):
            handoff.call_soon(loop, arrived, number)
        assert loop.handovers == 0 and received == []  # held during the pass
    assert drained(loop).wait(10)
    assert loop.handovers == 1
    assert received == list(range(32))
    assert threads == {loop.thread_id}  # run on the loop's thread


def test_outside_a_pass_and_from_other_threads_events_go_at_once(loop):
    handoff, received = Handoff(), []
    handoff.call_soon(loop, received.append, "alone")
    assert loop.handovers == 1
    with handoff.holding():
        other = threading.Thread(
            target=lambda: handoff.call_soon(loop, received.append, "other thread")
        )
        other.start()
        other.join(10)
        assert loop.handovers == 2  # not held: not the pass's thread
        handoff.call_soon(loop, received.append, "in the pass")
    assert drained(loop).wait(10)
    assert received == ["alone", "other thread", "in the pass"]


def test_a_pass_that_raises_still_hands_its_events_over(loop):
    handoff, received = Handoff(), []
    with pytest.raises(RuntimeError), handoff.holding():
        handoff.call_soon(loop, received.append, "before the failure")
        raise RuntimeError("the step failed")
    assert drained(loop).wait(10)
    assert received == ["before the failure"]
    handoff.call_soon(loop, received.append, "after")  # no longer held
    assert loop.handovers == 2
