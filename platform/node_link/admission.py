"""Who may start a link, before anyone is authenticated: the relay's guard
against whatever can reach its port.

A relay listens on an address other hosts reach, inside the supervisor: a
connection that never finishes its handshake holds a file descriptor of the
process that runs the engines. So, before a byte is read:

- at most MAX_HANDSHAKES connections are between accept and welcome at once,
  MAX_HANDSHAKES_PER_ADDRESS of them from one address; beyond, a connection
  is closed at once;
- the TLS handshake and the hello together get HANDSHAKE_S;
- an address whose hellos failed FAILED_HELLOS_PER_ADDRESS times in the last
  FAILED_WINDOW_S is refused without a database lookup, and at most
  MAX_LOOKUPS lookups run at once;
- every refusal is answered the same way (REFUSED: the caller learns nothing
  of which node names exist or why), and logged at most once per LOG_EVERY_S
  with how many were not.
"""

import logging
import time
from collections import Counter, OrderedDict, deque

log = logging.getLogger("roundhouse.relay")

MAX_HANDSHAKES = 64
MAX_HANDSHAKES_PER_ADDRESS = 8
HANDSHAKE_S = 2.0
FAILED_HELLOS_PER_ADDRESS = 10
FAILED_WINDOW_S = 60.0
MAX_LOOKUPS = 4
LOG_EVERY_S = 10.0
# Addresses whose failures are remembered (least recent forgotten first).
MAX_TRACKED_ADDRESSES = 4096
REFUSED = "link refused"


class Handshakes:
    """Connections between accept and welcome, counted in total and per
    source address."""

    def __init__(
        self,
        total: int = MAX_HANDSHAKES,
        per_address: int = MAX_HANDSHAKES_PER_ADDRESS,
    ) -> None:
        self.total = total
        self.per_address = per_address
        self._by_address: Counter[str] = Counter()

    @property
    def pending(self) -> int:
        return sum(self._by_address.values())

    def enter(self, address: str) -> bool:
        """Whether a handshake from `address` may start (then `leave` it)."""
        if self.pending >= self.total or self._by_address[address] >= self.per_address:
            return False
        self._by_address[address] += 1
        return True

    def leave(self, address: str) -> None:
        self._by_address[address] -= 1
        if self._by_address[address] <= 0:
            del self._by_address[address]


class FailedHellos:
    """Failed hellos per source address in a sliding window."""

    def __init__(
        self,
        limit: int = FAILED_HELLOS_PER_ADDRESS,
        window_s: float = FAILED_WINDOW_S,
        clock=time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, address: str) -> deque[float]:
        times = self._failures.get(address)
        if times is None:
            return deque()
        horizon = self._clock() - self.window_s
        while times and times[0] < horizon:
            times.popleft()
        return times

    def throttled(self, address: str) -> bool:
        """Whether `address` has used up its failures: refused unlooked-up."""
        return len(self._recent(address)) >= self.limit

    def failed(self, address: str) -> None:
        times = self._recent(address)
        if times:
            self._failures.move_to_end(address)
        else:
            self._failures[address] = times
            while len(self._failures) > MAX_TRACKED_ADDRESSES:
                self._failures.popitem(last=False)
        if len(times) < self.limit:
            times.append(self._clock())


class RefusalLog:
    """The relay's refusals in its log: the first at once, then at most one
    line per LOG_EVERY_S, saying how many were not logged."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock=time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._logged_at = -float("inf")
        self._unlogged = 0

    def refused(self, address: str, why: str) -> None:
        now = self._clock()
        if now - self._logged_at < self.every_s:
            self._unlogged += 1
            return
        more = (
            f" ({self._unlogged} more refused since the last line)"
            if self._unlogged
            else ""
        )
        log.warning("relay refused a link from %s: %s%s", address, why, more)
        self._logged_at = now
        self._unlogged = 0
