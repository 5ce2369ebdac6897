"""Events from the decode thread to an event loop: a pass's events held
while it runs and handed over in one call when it ends (Handoff)."""

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Handoff:
    """Callbacks for an event loop from the decode thread, held while it runs a
    pass and handed over when the pass ends, in one call_soon_threadsafe per
    loop: 32 streams' next tokens wake the loop once, not 32 times, and the
    loop turns them into frames beside the next llama_decode (which releases
    the GIL) instead of taking turns at the GIL with the pass that samples
    them. The order of the callbacks is kept. From any other thread, or from
    the decode thread outside a pass, a callback is handed over at once."""

    def __init__(self) -> None:
        self._holder: int | None = None  # the thread running a pass
        self._held: dict[Any, list[tuple[Callable, Any]]] = {}

    def call_soon(self, loop: Any, callback: Callable[[Any], None], arg: Any) -> None:
        """Run `callback(arg)` on `loop` (at once, or when the pass ends)."""
        if self._holder == threading.get_ident():
            self._held.setdefault(loop, []).append((callback, arg))
            return
        _hand_over(loop, callback, arg)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the calling thread's callbacks until the block ends."""
        self._holder = threading.get_ident()
        try:
            yield
        finally:
            self._holder = None
            held, self._held = self._held, {}
            for loop, calls in held.items():
                _hand_over(loop, _run_each, calls)


def _hand_over(loop: Any, callback: Callable[[Any], None], arg: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed at exit
        loop.call_soon_threadsafe(callback, arg)


def _run_each(calls: list[tuple[Callable, Any]]) -> None:
    for callback, arg in calls:
        callback(arg)
