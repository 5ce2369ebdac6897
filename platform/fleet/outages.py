"""A reader's own record of database outages (one per reading thread: the
front's snapshot loader, a node's heartbeat), so that heartbeats nobody could
write while the database was down are not taken for stopped writers when it
comes back: each writer writes again within a beat of the database's
return."""

import time

from .selectors import HEARTBEAT_STALE_S


class OutageClock:
    """failed() / worked() after each read; grace_s() for the next read."""

    def __init__(self) -> None:
        # time.monotonic(): when the outage this reader sees now began, and
        # the last one's (start, end).
        self.began: float | None = None
        self.last: tuple[float, float] | None = None

    def failed(self) -> None:
        if self.began is None:
            self.began = time.monotonic()

    def worked(self) -> None:
        if self.began is not None:
            self.last = (self.began, time.monotonic())
            self.began = None

    def grace_s(self) -> float:
        """How long the database has been down (the outage seen now, or the
        last one while it is recent enough to explain stale heartbeats);
        else 0."""
        now = time.monotonic()
        if self.began is not None:
            return now - self.began
        if self.last is None:
            return 0.0
        began, ended = self.last
        return ended - began if now - ended <= HEARTBEAT_STALE_S else 0.0
