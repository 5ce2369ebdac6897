"""What a batch run feeds its workers: the input file's lines one at a time
(never the whole file in memory), and room for the engine requests its key
may have in flight (a line waits for room here instead of being refused by
the key's batch budget and tried again)."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import BinaryIO

from .lines import Oversized, input_lines

Item = tuple[int, bytes | Oversized]


class LineFeed:
    """The file's lines not answered yet, (index, line), to any number of
    workers. Reading is blocking work: it runs in a thread, one line at a
    time. A worker cancelled while a line is being read for it does not lose
    that line: the next caller gets it."""

    def __init__(self, handle: BinaryIO, *, skip: set[int], max_bytes: int) -> None:
        self._lines: Iterator[Item] = (
            (index, line)
            for index, line in enumerate(input_lines(handle, max_bytes=max_bytes))
            if index not in skip
        )
        self._lock = asyncio.Lock()
        self._reading: asyncio.Future[Item | None] | None = None

    async def next(self) -> Item | None:
        """The next line to answer; None once the file is read."""
        async with self._lock:
            if self._reading is None:
                self._reading = asyncio.ensure_future(
                    asyncio.to_thread(next, self._lines, None)
                )
            item = await asyncio.shield(self._reading)
            self._reading = None
            return item


class Capacity:
    """At most `limit` engine requests of a run in flight at once (None: no
    limit); a line of weight w waits for w of them."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0
        self._freed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, weight: int) -> AsyncIterator[None]:
        if self.limit is None:
            yield
            return
        # One heavier than the whole limit waits for all of it (and is then
        # refused by the budget as too heavy: a 400, not a wait).
        weight = min(max(1, weight), self.limit)
        while self.used + weight > self.limit:
            self._freed.clear()  # no await between the check and the wait
            await self._freed.wait()
        self.used += weight
        try:
            yield
        finally:
            self.used -= weight
            self._freed.set()
