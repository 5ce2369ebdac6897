"""The counters behind the API's limits (api.limits): requests per window and
concurrency leases, shared by every front and worker through Redis
(REDIS_URL), or counted in this process.

Redis makes the limits shared; it is never a dependency. Every Redis call is
bounded (settings.REDIS_CONNECT_TIMEOUT_S to connect, REDIS_TIMEOUT_S to
answer). A call that fails or times out marks Redis unavailable: from then on
every process counts its own callers alone ("local" in /healthz, one warning
in the log), so a caller may get up to its limits once per front while Redis
is gone, and no request waits on Redis at all. A background thread asks Redis
again every TICK_S; when it answers, counting is shared again (logged once).

This process always counts what it admits (`LocalCounters`), shared or not:
so the counts it falls back to include the requests it already holds.

In Redis, one clock decides: windows and lease terms are computed in Lua from
Redis's own TIME, so fronts whose clocks disagree still count in the same
window. A concurrency slot is a lease (one sorted-set member per unit of
weight, scored by when it expires), renewed every TICK_S by this process's
thread while its request runs and removed when it ends; expired members are
dropped at every admission, so the slots of a process that was killed are
free within LEASE_S.
"""

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

log = logging.getLogger("roundhouse.api")

KEY_PREFIX = "roundhouse:limits:"
# A lease's term, and how often the thread renews leases (and, while Redis is
# unavailable, asks it again).
LEASE_S = 10.0
TICK_S = 3.0
# Windows this process remembers at most (one per caller with a rate limit).
MAX_LOCAL_WINDOWS = 100_000

# KEYS[1]: the caller's window hash; ARGV[1]: the window's length in seconds.
# Returns the count in the current window, and milliseconds to its end.
_COUNT = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
local length = tonumber(ARGV[1])
local window = math.floor(t / length)
local stored = tonumber(redis.call('HGET', KEYS[1], 'w'))
if stored == nil or stored < window then
  redis.call('HSET', KEYS[1], 'w', window, 'n', 0)
else
  window = stored
end
local count = redis.call('HINCRBY', KEYS[1], 'n', 1)
redis.call('EXPIRE', KEYS[1], math.ceil(2 * length))
return {count, math.ceil(((window + 1) * length - t) * 1000)}
"""

# KEYS[1]: the caller's leases; ARGV: limit, lease term (s), members to add.
# Drops expired members, then adds these if they fit: 1 taken, 0 refused.
_TAKE = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t)
local held = redis.call('ZCARD', KEYS[1])
if held + #ARGV - 2 > tonumber(ARGV[1]) then
  return 0
end
local term = tonumber(ARGV[2])
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], t + term, ARGV[i])
end
redis.call('EXPIRE', KEYS[1], math.ceil(term) + 1)
return 1
"""

# KEYS[1]: the caller's leases; ARGV: lease term (s), members to renew. A
# member already expired (and dropped) is not brought back.
_RENEW = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
local term = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', t + term, ARGV[i])
end
redis.call('EXPIRE', KEYS[1], math.ceil(term) + 1)
return 1
"""

# What a failing Redis raises: its client's errors, and the socket's own.
REDIS_FAILURES = (RedisError, OSError, TimeoutError)


@dataclass(frozen=True)
class Lease:
    """Concurrency taken for one request: `weight` units of `scope`'s;
    `lease_id` names its members in Redis ("": counted in this process only)."""

    scope: str
    weight: int
    lease_id: str = ""
    counters: "Counters | None" = field(default=None, repr=False, compare=False)

    @property
    def members(self) -> list[str]:
        return [f"{self.lease_id}:{unit}" for unit in range(self.weight)]


class LocalCounters:
    """This process's own counts: windows by the process's clock, and the
    concurrency it holds (exact: given back when each request ends, and gone
    with the process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[int, int]] = {}  # scope -> (window, count)
        self._held: dict[str, int] = {}

    def count(self, scope: str, window_s: float) -> tuple[int, float]:
        """Count one request in `scope`'s current window: the count, and
        seconds to the window's end."""
        now = time.time()
        window = int(now // window_s)
        with self._lock:
            found = self._windows.get(scope)
            count = found[1] + 1 if found and found[0] == window else 1
            if len(self._windows) >= MAX_LOCAL_WINDOWS and found is None:
                self._windows = {
                    name: kept
                    for name, kept in self._windows.items()
                    if kept[0] == window
                }
                while len(self._windows) >= MAX_LOCAL_WINDOWS:
                    del self._windows[next(iter(self._windows))]
            self._windows[scope] = (window, count)
        return count, (window + 1) * window_s - now

    def take(self, scope: str, weight: int, limit: int | None) -> bool:
        """Hold `weight` more of `scope`, if that stays within `limit` (None:
        hold it whatever it makes)."""
        with self._lock:
            held = self._held.get(scope, 0)
            if limit is not None and held + weight > limit:
                return False
            self._held[scope] = held + weight
            return True

    def give_back(self, scope: str, weight: int) -> None:
        with self._lock:
            left = self._held.get(scope, 0) - weight
            if left > 0:
                self._held[scope] = left
            else:
                self._held.pop(scope, None)

    def held(self, scope: str) -> int:
        return self._held.get(scope, 0)

    def clear(self) -> None:
        with self._lock:
            self._windows.clear()
            self._held.clear()


class RedisCounters:
    """The shared counts, in Redis, each call bounded by the timeouts."""

    def __init__(self, url: str) -> None:
        # No retries: a failed call falls back at once, rather than waiting
        # the timeouts again (redis-py retries three times by default).
        self.client = redis.Redis.from_url(
            url,
            socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT_S,
            socket_timeout=settings.REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        self._count = self.client.register_script(_COUNT)
        self._take = self.client.register_script(_TAKE)
        self._renew = self.client.register_script(_RENEW)

    def count(self, scope: str, window_s: float) -> tuple[int, float]:
        count, left_ms = self._count(keys=[f"{KEY_PREFIX}rl:{scope}"], args=[window_s])
        return int(count), int(left_ms) / 1000

    def take(self, lease: Lease, limit: int) -> bool:
        key = f"{KEY_PREFIX}cc:{lease.scope}"
        return bool(self._take(keys=[key], args=[limit, LEASE_S, *lease.members]))

    def renew(self, leases: list[Lease]) -> None:
        """Extend these leases' terms, in one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            for lease in leases:
                key = f"{KEY_PREFIX}cc:{lease.scope}"
                self._renew(keys=[key], args=[LEASE_S, *lease.members], client=pipe)
            pipe.execute()

    def give_back(self, lease: Lease) -> None:
        self.client.zrem(f"{KEY_PREFIX}cc:{lease.scope}", *lease.members)

    def ping(self) -> None:
        self.client.ping()


class Counters:
    """count() / take() / give_back() of one REDIS_URL (""): in Redis while
    it answers, else in this process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.local = LocalCounters()
        self.shared = RedisCounters(url) if url else None
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}  # held in Redis: renewed
        self._unavailable = ""  # why Redis is not used now ("": it is)
        self._wake = threading.Event()  # work arrived for an idle thread
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # the running thread's
        self._pid = 0

    @property
    def sharing(self) -> bool:
        """Whether Redis is asked now."""
        return self.shared is not None and not self._unavailable

    def mode(self) -> str:
        """How callers are counted now, for /healthz."""
        if self.shared is None:
            return "local (no REDIS_URL)"
        reason = self._unavailable
        return f"local (Redis unavailable: {reason})" if reason else "shared"

    def count(self, scope: str, window_s: float) -> tuple[int, float]:
        """Count one request of `scope` in its current window: its count
        (shared, or this process's) and seconds to the window's end."""
        local = self.local.count(scope, window_s)
        if self.sharing:
            try:
                return self.shared.count(scope, window_s)
            except REDIS_FAILURES as error:
                self._failed(error)
        return local

    def take(self, scope: str, weight: int, limit: int) -> Lease | None:
        """Take `weight` of `scope`'s concurrency if it stays within `limit`:
        the lease, or None (nothing taken)."""
        if self.sharing:
            lease = Lease(scope, weight, uuid.uuid4().hex, self)
            try:
                taken = self.shared.take(lease, limit)
            except REDIS_FAILURES as error:
                self._failed(error)
            else:
                if not taken:
                    return None
                self.local.take(scope, weight, None)
                with self._lock:
                    self._leases[lease.lease_id] = lease
                self._running()
                return lease
        if not self.local.take(scope, weight, limit):
            return None
        return Lease(scope, weight, "", self)

    def give_back(self, lease: Lease) -> None:
        """End a lease (in Redis too, while it answers: an unanswered one
        expires there within LEASE_S)."""
        self.local.give_back(lease.scope, lease.weight)
        if not lease.lease_id:
            return
        with self._lock:
            self._leases.pop(lease.lease_id, None)
        if self.sharing:
            try:
                self.shared.give_back(lease)
            except REDIS_FAILURES as error:
                self._failed(error)

    def forget(self) -> None:
        """Forget every count and outage of this process, and stop the
        thread (the next lease starts one that reads the constants anew):
        tests."""
        self.local.clear()
        with self._lock:
            self._leases.clear()
            self._stop.set()
            self._thread = None
        self._wake.set()
        self._unavailable = ""

    def _failed(self, error: BaseException) -> None:
        reason = f"{type(error).__name__}: {error}"
        with self._lock:
            first, self._unavailable = not self._unavailable, reason
        if first:
            log.warning(
                "limits counted in this process alone: Redis unavailable (%s); "
                "asking it again every %g s",
                reason,
                TICK_S,
            )
        self._running()

    def _running(self) -> None:
        """Make sure the thread that renews leases and asks Redis again runs
        (in this process: a forked one starts its own), and wake it."""
        with self._lock:
            thread = self._thread
            if thread is None or not thread.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._stop = threading.Event()
                thread = self._thread = threading.Thread(
                    target=self._tend,
                    args=(self._stop,),
                    name="limits-redis",
                    daemon=True,
                )
                thread.start()
        self._wake.set()

    def _tend(self, stop: threading.Event) -> None:
        """Every TICK_S while there is work (leases held, or Redis to ask
        again): renew the leases, or ask Redis whether it is back. Sleeps on
        an event otherwise."""
        while not stop.is_set():
            if not (self._leases or self._unavailable):
                self._wake.wait()
                self._wake.clear()
                continue
            if stop.wait(TICK_S):
                return
            try:
                self._tick()
            except Exception:  # this thread must outlive any error
                log.exception("limits: renewing leases failed")

    def _tick(self) -> None:
        if self._unavailable:
            try:
                self.shared.ping()
            except REDIS_FAILURES as error:
                self._unavailable = f"{type(error).__name__}: {error}"
                return
            self._unavailable = ""
            log.warning("limits shared through Redis again")
            return
        with self._lock:
            leases = list(self._leases.values())
        if leases:
            try:
                self.shared.renew(leases)
            except REDIS_FAILURES as error:
                self._failed(error)


_by_url: dict[str, Counters] = {}
_by_url_lock = threading.Lock()


def counters() -> Counters:
    """The counters of this process's REDIS_URL (read each time: tests
    change it)."""
    url = settings.REDIS_URL
    found = _by_url.get(url)
    if found is None:
        with _by_url_lock:
            if url not in _by_url:
                _by_url[url] = Counters(url)
            found = _by_url[url]
    return found


def forget() -> None:
    """Forget every count and outage of this process (tests)."""
    for each in list(_by_url.values()):
        each.forget()
