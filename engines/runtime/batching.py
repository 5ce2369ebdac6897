"""Dynamic micro-batching: requests from any number of connections are gathered
over a short window into one model call, and each caller gets its own rows back."""

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from engines.wire.errors import ErrorCode, ProtocolError


@dataclass
class _Pending:
    items: Sequence[str]
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)
    tokens: int = 0  # the model's token count for these items, when it gives one


@dataclass
class BatchStats:
    batches: int = 0
    items: int = 0
    largest: int = 0


class MicroBatcher:
    """Gathers requests for one model and runs them through `process` together.

    The loop sleeps on an event while nothing is pending (no polling: an idle
    engine uses no CPU). Once woken it waits `window_s` for more requests to join,
    takes requests in arrival order up to `max_batch_size` items (always at least
    one request), runs `process` off the event loop, checks it returned one row per
    item, and slices the rows back to each caller. A failing batch fails only its
    own callers; requests that waited past `queue_timeout_s` are refused as
    overloaded instead of run. `process` may also return (rows, token counts per
    item); each caller then gets its items' token total from `submit_counted`.
    """

    def __init__(
        self,
        process: Callable[[list[str]], np.ndarray | tuple[np.ndarray, np.ndarray]],
        *,
        executor: Executor,
        window_s: float,
        max_batch_size: int,
        queue_timeout_s: float = 60.0,
        allowed: asyncio.Event | None = None,
    ) -> None:
        self._process = process
        # Cleared while the engine cools: queued requests wait for it.
        self._allowed = allowed
        self._executor = executor
        self.window_s = window_s
        self.max_batch_size = max_batch_size
        self.queue_timeout_s = queue_timeout_s
        self._pending: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.running = 0
        self.stats = BatchStats()

    @property
    def queued_items(self) -> int:
        return sum(len(request.items) for request in self._pending)

    @property
    def queued_requests(self) -> int:
        return len(self._pending)

    def configure(
        self, *, window_s: float, max_batch_size: int, queue_timeout_s: float
    ) -> None:
        """New limits, in force from the next batch."""
        self.window_s = window_s
        self.max_batch_size = max_batch_size
        self.queue_timeout_s = queue_timeout_s

    async def submit(self, items: Sequence[str]) -> np.ndarray:
        """Queue items and wait for their rows."""
        rows, _ = await self.submit_counted(items)
        return rows

    async def submit_counted(self, items: Sequence[str]) -> tuple[np.ndarray, int]:
        """Queue items and wait for their rows and their token total (0 when the
        model does not count)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="micro-batcher")
        future = asyncio.get_running_loop().create_future()
        pending = _Pending(items, future)
        self._pending.append(pending)
        self._wakeup.set()
        return await future, pending.tokens

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            if self._allowed is not None:
                await self._allowed.wait()
            batch = self._take()
            if not self._pending:
                self._wakeup.clear()
            if batch:
                await self._run(batch)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        size = 0
        now = time.monotonic()
        while self._pending:
            request = self._pending[0]
            if request.future.done():  # its caller went away
                self._pending.popleft()
                continue
            if 0 < self.queue_timeout_s < now - request.queued_at:
                self._pending.popleft()
                request.future.set_exception(
                    ProtocolError(
                        ErrorCode.OVERLOADED,
                        f"waited more than {self.queue_timeout_s:g} s in the queue",
                    )
                )
                continue
            if batch and size + len(request.items) > self.max_batch_size:
                break
            self._pending.popleft()
            batch.append(request)
            size += len(request.items)
        return batch

    async def _run(self, batch: list[_Pending]) -> None:
        items = [item for request in batch for item in request.items]
        self.running += 1
        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._executor, self._process, items)
            rows, counts = result if isinstance(result, tuple) else (result, None)
            if counts is not None and len(counts) != len(items):
                raise RuntimeError(f"{len(counts)} token counts for {len(items)}")
            if len(rows) != len(items):
                raise RuntimeError(f"model returned {len(rows)} rows for {len(items)}")
        except Exception as error:  # noqa: BLE001 - fail this batch's callers only
            failure = ProtocolError(ErrorCode.INTERNAL, f"batch failed: {error}")
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(failure)
            return
        finally:
            self.running -= 1
        self.stats.batches += 1
        self.stats.items += len(items)
        self.stats.largest = max(self.stats.largest, len(items))
        offset = 0
        for request in batch:
            count = len(request.items)
            if counts is not None:
                request.tokens = int(sum(counts[offset : offset + count]))
            if not request.future.done():
                request.future.set_result(rows[offset : offset + count])
            offset += count

    async def close(self) -> None:
        """Stop the loop; anything still queued is cancelled."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        while self._pending:
            request = self._pending.popleft()
            if not request.future.done():
                request.future.set_exception(
                    ProtocolError(ErrorCode.CANCELLED, "engine is shutting down")
                )
