"""Admission of every caller (requests per minute, engine requests in flight)
and the per-client throttle on failed keys.

Every caller is admitted against an `Allowance`: an API key's own limits, a
logged-in user's (api.selectors.user_allowance: the defaults in the admin, or
the user's override), or a key's batches' (the key's numbers, counted apart
from its live requests, so a batch never starves its owner's live calls). The
counts are api.counters': in Redis (REDIS_URL), so every front and worker
shares them, or in this process; while Redis is unavailable, each process
counts on its own (never an error for the caller; /healthz says which).

- Rate: a fixed one-minute window (by Redis's clock when shared). Each request
  counts in its caller's current window; a count above the rpm limit is
  refused until the next window starts. Refused requests count too, so
  retrying in a loop does not help.
- Concurrency: a request weighs as many engine requests as it opens (`n`
  choices weigh n). It takes its weight as a lease when the caller's leases
  leave room for it under max_concurrent, else it is refused with nothing
  taken. On exit it gives the lease back, exactly once, even when cancelled.
  A lease in Redis lasts counters.LEASE_S and is renewed while its request
  runs: the slots of a process that was killed are free within that.

The throttle on failed keys (`FailureThrottle`) counts in this process's memory:
it exists to keep a flood of bad keys off the database, so it must cost nothing.
"""

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from .counters import Lease, counters
from .errors import ApiCode
from .exceptions import LimitExceeded
from .models import ApiKey

__all__ = [
    "Allowance",
    "FailureThrottle",
    "LimitExceeded",
    "admission",
    "key_admission",
    "mode",
]

log = logging.getLogger("roundhouse.api")

RATE_WINDOW_S = 60

# Give-backs of leases whose taking outlived a cancelled request; kept
# referenced until they finish (the event loop holds tasks only weakly).
_releasing: set[asyncio.Task] = set()


@dataclass(frozen=True)
class Allowance:
    """Whose counters a request counts in (`scope`, unique per caller and
    budget), and their limits (0: unlimited)."""

    scope: str
    rpm_limit: int
    max_concurrent: int
    # Who is over the limit, in the refusal's message.
    who: str = "this API key"

    @classmethod
    def of_key(cls, key: ApiKey) -> "Allowance":
        """A key's live requests (REST, and WebSocket chat with a key)."""
        return cls(str(key.pk), key.rpm_limit, key.max_concurrent)

    @classmethod
    def of_key_batches(cls, key: ApiKey) -> "Allowance":
        """A key's batch lines: the key's numbers, counted apart from its live
        requests."""
        return cls(
            f"b{key.pk}",
            key.rpm_limit,
            key.max_concurrent,
            who="this API key's batches",
        )

    @property
    def limited(self) -> bool:
        return bool(self.rpm_limit or self.max_concurrent)


def mode() -> str:
    """How this process counts callers now: "shared" (Redis), or "local
    (...)" and why (for /healthz)."""
    return counters().mode()


class TooHeavy(LimitExceeded):
    """A request that weighs more than its caller's whole concurrency: it
    could never be admitted (HTTP 400, not a 429 to retry)."""


def _admit(allowance: Allowance, weight: int) -> Lease | None:
    """Count the request in the caller's minute (a request refused as too
    heavy counts too: a flood of them turns into 429s), then take `weight` of
    its concurrency: the lease taken (None when it has no concurrency limit),
    or LimitExceeded (nothing taken)."""
    if allowance.rpm_limit:
        count, left_s = counters().count(allowance.scope, RATE_WINDOW_S)
        if count > allowance.rpm_limit:
            retry_after_s = max(1, math.ceil(left_s))
            raise LimitExceeded(
                f"Rate limit reached for {allowance.who}: {allowance.rpm_limit} "
                f"requests per minute. Try again in {retry_after_s} s.",
                retry_after_s,
            )
    if allowance.max_concurrent and weight > allowance.max_concurrent:
        raise TooHeavy(
            f"This request opens {weight} engine requests; {allowance.who} may "
            f"have at most {allowance.max_concurrent} in flight. Ask for fewer "
            "choices (n).",
            1,
            code=ApiCode.CONCURRENCY_LIMIT_EXCEEDED,
        )
    if not allowance.max_concurrent:
        return None
    lease = counters().take(allowance.scope, weight, allowance.max_concurrent)
    if lease is None:
        raise LimitExceeded(
            f"Too many concurrent requests for {allowance.who}: at most "
            f"{allowance.max_concurrent} at once (a request with n choices "
            "counts n).",
            1,
            code=ApiCode.CONCURRENCY_LIMIT_EXCEEDED,
        )
    return lease


def _give_back_lease(lease: Lease) -> None:
    lease.counters.give_back(lease)


# Redis is called off the event loop (each call bounded by the Redis
# timeouts), in one thread hop per request on the way in; counting in this
# process (no REDIS_URL, or Redis unavailable) takes microseconds and runs on
# the loop. Not thread-sensitive: counting should not queue behind ORM calls.
_admit_async = sync_to_async(_admit, thread_sensitive=False)
_give_back_async = sync_to_async(_give_back_lease, thread_sensitive=False)


def _give_back_if_taken(taking: asyncio.Task) -> None:
    """Once a taking abandoned by a cancelled request ends, give back its lease."""
    if taking.cancelled() or taking.exception() is not None:
        return
    lease = taking.result()
    if lease is not None:
        releasing = asyncio.ensure_future(_give_back_async(lease))
        _releasing.add(releasing)
        releasing.add_done_callback(_releasing.discard)


async def _take(allowance: Allowance, weight: int) -> Lease | None:
    if not counters().sharing:
        return _admit(allowance, weight)
    # Shielded: a cancellation while the counters are being incremented must not
    # lose track of the increment, so the taking runs on and is given back.
    taking = asyncio.ensure_future(_admit_async(allowance, weight))
    try:
        return await asyncio.shield(taking)
    except asyncio.CancelledError:
        taking.add_done_callback(_give_back_if_taken)
        raise


async def _give_back(lease: Lease) -> None:
    if not (lease.lease_id and lease.counters.sharing):
        _give_back_lease(lease)
    else:
        await asyncio.shield(_give_back_async(lease))


@asynccontextmanager
async def admission(allowance: Allowance, *, weight: int = 1) -> AsyncIterator[None]:
    """Admit one request of this caller, weighing `weight` engine requests,
    for the duration of the block.

    Raises LimitExceeded when the caller is over its requests per minute
    (retry_after_s: seconds to the next minute) or its concurrent engine
    requests (retry_after_s: 1), TooHeavy when `weight` alone is over the
    latter. A refused request holds no concurrency; an admitted one gives its
    weight back exactly once when the block ends, however it ends.
    """
    lease = await _take(allowance, max(1, weight)) if allowance.limited else None
    try:
        yield
    finally:
        if lease is not None:
            await _give_back(lease)


def key_admission(key: ApiKey, *, weight: int = 1):
    """`admission` of one live request of this key."""
    return admission(Allowance.of_key(key), weight=weight)


class FailureThrottle:
    """Failed key lookups per client, in fixed windows: a client with `limit`
    failures in a window is refused until the window ends (LimitExceeded with
    the seconds left), without its keys being looked up.

    Only lookups that failed count. So that concurrent bad keys cannot all be
    looked up before the first of them fails, a client may have at most as
    many lookups in flight as it has failures left in its window
    (`lookup_slot`, `lookup_done`): the rest wait their turn (a burst of good
    keys behind one proxy address is answered, later) and are refused once
    the lookups before them used up the window.

    Memory is bounded: at most `max_clients` are tracked; past that the one
    that failed least recently is forgotten (and starts counting again).
    Lookups in flight and their waiters are bounded by the requests open.
    """

    def __init__(
        self, *, limit: int, window_s: float, max_clients: int = 10_000
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_clients = max_clients
        self.clock = time.monotonic
        # client -> (start of its window, failures in it); the client that
        # failed least recently first.
        self._windows: dict[str, tuple[float, int]] = {}
        self._in_flight: dict[str, int] = {}
        self._waiting: dict[str, list[asyncio.Future]] = {}

    def check(self, client: str) -> None:
        """LimitExceeded if the client is over its failures in this window."""
        found = self._windows.get(client)
        if found is None or found[1] < self.limit:
            return
        left = found[0] + self.window_s - self.clock()
        if left <= 0:
            del self._windows[client]
            return
        raise LimitExceeded(
            f"Too many requests with invalid API keys from this client. Try "
            f"again in {math.ceil(left)} s.",
            math.ceil(left),
            code=ApiCode.TOO_MANY_INVALID_KEYS,
        )

    def _failures(self, client: str) -> int:
        found = self._windows.get(client)
        if found is None or self.clock() - found[0] >= self.window_s:
            return 0
        return found[1]

    async def lookup_slot(self, client: str) -> None:
        """Take one of the client's lookups in flight, waiting while its
        lookups in flight would reach its failures left; LimitExceeded once
        it is over them. Give it back with `lookup_done`."""
        while True:
            self.check(client)
            in_flight = self._in_flight.get(client, 0)
            if in_flight + self._failures(client) < self.limit:
                self._in_flight[client] = in_flight + 1
                return
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(client, []).append(waiter)
            try:
                await waiter
            finally:
                waiters = self._waiting.get(client, [])
                if waiter in waiters:
                    waiters.remove(waiter)
                if not waiters:
                    self._waiting.pop(client, None)

    def lookup_done(self, client: str) -> None:
        """One of the client's lookups ended (its failure, if it failed,
        counted first): the client's waiters look again."""
        left = self._in_flight.get(client, 0) - 1
        if left > 0:
            self._in_flight[client] = left
        else:
            self._in_flight.pop(client, None)
        for waiter in self._waiting.pop(client, []):
            if not waiter.done():
                waiter.set_result(None)

    def failed(self, client: str) -> None:
        """Count one failed key lookup of the client."""
        now = self.clock()
        found = self._windows.pop(client, None)
        if found is None or now - found[0] >= self.window_s:
            found = (now, 0)
        while len(self._windows) >= self.max_clients:
            del self._windows[next(iter(self._windows))]
        self._windows[client] = (found[0], found[1] + 1)  # now the newest

    def clear(self) -> None:
        """Forget every client."""
        self._windows.clear()
        self._in_flight.clear()
        self._waiting.clear()

    def __len__(self) -> int:
        return len(self._windows)
