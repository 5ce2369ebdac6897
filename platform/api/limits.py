"""Admission of every caller (requests per minute, engine requests in flight)
and the per-client throttle on failed keys.

Every caller is admitted against an `Allowance`: an API key's own limits, a
logged-in user's (api.selectors.user_allowance: the defaults in the admin, or
the user's override), or a key's batches' (the key's numbers, counted apart
from its live requests, so a batch never starves its owner's live calls). The
limits are counters in Django's default cache, so front processes and workers
that share the cache (Redis, see CACHES in settings) share them.

- Rate: a fixed one-minute window. Each request increments `rl:<scope>:<minute>`
  (kept for two windows); a count above the rpm limit is refused until the
  next minute starts. Refused requests count too, so retrying in a loop does not
  help.
- Concurrency: a request weighs as many engine requests as it opens (`n`
  choices weigh n). It adds its weight to `cc:<scope>:<epoch>` for the current
  ten-minute epoch and adds the previous epoch's counter; when the sum is above
  max_concurrent it gives its weight back at once and is refused. On exit it
  takes back what it added, exactly once, even when cancelled.
  Counters live two epochs and a minute, and only the current and previous epoch
  are read: a slot leaked by a crashed process is forgotten within twenty minutes,
  while a live request counts for at least ten (one running longer than that stops
  counting toward the limit). A single counter with a TTL could not do both: a
  TTL refreshed on use keeps a leaked slot while the key is busy, and one that is
  not refreshed drops the count of requests still in flight.

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
from django.core.cache import DEFAULT_CACHE_ALIAS, cache, caches
from django.core.cache.backends.locmem import LocMemCache

from .errors import ApiCode
from .exceptions import LimitExceeded
from .models import ApiKey

__all__ = [
    "Allowance",
    "FailureThrottle",
    "LimitExceeded",
    "admission",
    "key_admission",
]

log = logging.getLogger("roundhouse.api")

RATE_WINDOW_S = 60
# A rate counter outlives its window by one more, for clocks of front processes
# that disagree by a few seconds.
RATE_TTL_S = 2 * RATE_WINDOW_S
CONCURRENCY_EPOCH_S = 600
CONCURRENCY_TTL_S = 2 * CONCURRENCY_EPOCH_S + 60

# Give-backs of slots whose taking outlived a cancelled request; kept referenced
# until they finish (the event loop holds tasks only weakly).
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


@dataclass(frozen=True)
class _Slot:
    """Taken concurrency: the counter that was incremented, by how much, and
    its epoch."""

    cache_key: str
    epoch: int
    weight: int = 1


def _count(cache_key: str, *, ttl_s: int, delta: int = 1) -> int:
    """Increment a counter, creating it with this TTL when missing; the new value."""
    try:
        return cache.incr(cache_key, delta)
    except ValueError:
        # Missing: create it. Another process may create it first; add() keeps
        # theirs and both increments count.
        cache.add(cache_key, 0, timeout=ttl_s)
        return cache.incr(cache_key, delta)


def _rate_count(allowance: Allowance) -> int | None:
    """Count a request in the caller's current minute; seconds to wait when over."""
    now = time.time()
    window = int(now) // RATE_WINDOW_S
    count = _count(f"rl:{allowance.scope}:{window}", ttl_s=RATE_TTL_S)
    if count <= allowance.rpm_limit:
        return None
    return max(1, (window + 1) * RATE_WINDOW_S - int(now))


def _slot_take(allowance: Allowance, weight: int) -> _Slot | None:
    """Take `weight` of the caller's concurrency; None (nothing taken) when
    that would go over its limit."""
    epoch = int(time.time()) // CONCURRENCY_EPOCH_S
    slot = _Slot(cache_key=f"cc:{allowance.scope}:{epoch}", epoch=epoch, weight=weight)
    in_flight = _count(slot.cache_key, ttl_s=CONCURRENCY_TTL_S, delta=weight)
    in_flight += max(0, cache.get(f"cc:{allowance.scope}:{epoch - 1}", 0))
    if in_flight > allowance.max_concurrent:
        _slot_give_back(slot)
        return None
    return slot


def _slot_give_back(slot: _Slot) -> None:
    """Take back what a slot added to its counter, while that counter is still
    read."""
    if int(time.time()) // CONCURRENCY_EPOCH_S > slot.epoch + 1:
        # No longer read, and soon expired: decrementing could recreate it.
        return
    try:
        cache.decr(slot.cache_key, slot.weight)
    except ValueError:
        pass  # Evicted: nothing left to give back.
    except Exception:
        # The cache is unreachable. The slot is forgotten when its epoch ends;
        # failing the request that is leaving would not bring it back sooner.
        log.exception("could not give back a concurrency slot (%s)", slot.cache_key)


class TooHeavy(LimitExceeded):
    """A request that weighs more than its caller's whole concurrency: it
    could never be admitted (HTTP 400, not a 429 to retry)."""


def _admit(allowance: Allowance, weight: int) -> _Slot | None:
    """Count the request in the caller's minute (a request refused as too
    heavy counts too: a flood of them turns into 429s), then take `weight` of
    its concurrency: the slot taken (None when it has no concurrency limit), or
    LimitExceeded (nothing taken)."""
    if allowance.rpm_limit:
        retry_after_s = _rate_count(allowance)
        if retry_after_s is not None:
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
    slot = _slot_take(allowance, weight)
    if slot is None:
        raise LimitExceeded(
            f"Too many concurrent requests for {allowance.who}: at most "
            f"{allowance.max_concurrent} at once (a request with n choices "
            "counts n).",
            1,
            code=ApiCode.CONCURRENCY_LIMIT_EXCEEDED,
        )
    return slot


# The cache's own incr/decr: atomic (Redis INCRBY, LocMemCache under its lock),
# while BaseCache.aincr is a get then a set, which loses concurrent increments
# and resets the TTL. A cache in this process answers in microseconds and is
# called on the event loop; any other (Redis) is called off it, in one thread
# hop per request on the way in. Not thread-sensitive: cache clients are
# thread-safe, and counting should not queue behind ORM calls.
_admit_async = sync_to_async(_admit, thread_sensitive=False)
_slot_give_back_async = sync_to_async(_slot_give_back, thread_sensitive=False)


def _in_process() -> bool:
    return isinstance(caches[DEFAULT_CACHE_ALIAS], LocMemCache)


def _give_back_if_taken(taking: asyncio.Task) -> None:
    """Once a taking abandoned by a cancelled request ends, give back its slot."""
    if taking.cancelled() or taking.exception() is not None:
        return
    slot = taking.result()
    if slot is not None:
        releasing = asyncio.ensure_future(_slot_give_back_async(slot))
        _releasing.add(releasing)
        releasing.add_done_callback(_releasing.discard)


async def _take(allowance: Allowance, weight: int) -> _Slot | None:
    if _in_process():
        return _admit(allowance, weight)
    # Shielded: a cancellation while the counters are being incremented must not
    # lose track of the increment, so the taking runs on and is given back.
    taking = asyncio.ensure_future(_admit_async(allowance, weight))
    try:
        return await asyncio.shield(taking)
    except asyncio.CancelledError:
        taking.add_done_callback(_give_back_if_taken)
        raise


async def _give_back(slot: _Slot) -> None:
    if _in_process():
        _slot_give_back(slot)
    else:
        await asyncio.shield(_slot_give_back_async(slot))


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
    slot = await _take(allowance, max(1, weight)) if allowance.limited else None
    try:
        yield
    finally:
        if slot is not None:
            await _give_back(slot)


def key_admission(key: ApiKey, *, weight: int = 1):
    """`admission` of one live request of this key."""
    return admission(Allowance.of_key(key), weight=weight)


class FailureThrottle:
    """Failed key lookups per client, in fixed windows: a client with `limit`
    failures in a window is refused until the window ends (LimitExceeded with
    the seconds left), without its keys being looked up.

    Callers count a lookup as failed before making it, and `take_back` when it
    finds the key: lookups in flight count, so that concurrent requests cannot
    all pass `check` before the first of them fails.

    Memory is bounded: at most `max_clients` are tracked; past that the one
    that failed least recently is forgotten (and starts counting again).
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

    def failed(self, client: str) -> None:
        """Count one failed key lookup of the client."""
        now = self.clock()
        found = self._windows.pop(client, None)
        if found is None or now - found[0] >= self.window_s:
            found = (now, 0)
        while len(self._windows) >= self.max_clients:
            del self._windows[next(iter(self._windows))]
        self._windows[client] = (found[0], found[1] + 1)  # now the newest

    def take_back(self, client: str) -> None:
        """Take back one failure counted for the client: its lookup found the
        key, or could not be made."""
        found = self._windows.get(client)
        if found is not None and found[1] > 0:
            self._windows[client] = (found[0], found[1] - 1)

    def clear(self) -> None:
        """Forget every client."""
        self._windows.clear()

    def __len__(self) -> int:
        return len(self._windows)
