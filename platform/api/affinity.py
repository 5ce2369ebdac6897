"""Cache-aware routing shared by every front: which engine last served a
conversation's prefix, in Redis (REDIS_URL) as well as in this front's own
map (routing.affinity.AffinityMap).

A conversation whose turns reach different fronts (several fronts behind a
load balancer, or on several nodes) still goes back to the engine whose prompt
cache holds it: each front writes the prefixes it routed to Redis, and looks a
new request's prefixes up there, longest first. Only models with replicas
look (one engine holds a model of one replica anyway).

Redis is an aid, never a dependency: a lookup that takes longer than
LOOKUP_TIMEOUT_S (CONNECT_TIMEOUT_S for a loop's first, which connects) or
fails uses this front's own map instead; after a failure,
or SLOW_LOOKUPS_DOWN slow lookups in a row, Redis is left alone for
RETRY_AFTER_S (logged once per outage).
Writes leave the request's path: they run after it, in a task of their own.
Of a request's prefixes, Redis gets two: the longest (all its messages: the
conversation's next turn carries them) and the first (a system prompt that
many conversations share); this front's map keeps them all. Keys expire after
TTL_S (an engine's slots have long reused an idle conversation's cache by
then); each is a hash of the model's name and the messages (no text of them
is stored). A key's value names the engine and which start
of it served the prefix (EngineStatus.incarnation): an engine restarted since
has nothing of it in its cache, and is not preferred for it.
"""

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from routing.affinity import AffinityMap
from routing.select import EngineStatus

log = logging.getLogger("roundhouse.affinity")

KEY_PREFIX = "roundhouse:affinity:"
TTL_S = 1200
LOOKUP_TIMEOUT_S = 0.25
# A loop's first lookup also opens its first connection: it gets longer.
CONNECT_TIMEOUT_S = 1.0
SLOW_LOOKUPS_DOWN = 3
WRITE_TIMEOUT_S = 1.0
RETRY_AFTER_S = 5.0


# Connections per event loop: lookups beyond wait for one (within their
# bound); writes are batched by one writer task per loop, whose queue keeps at
# most MAX_PENDING_WRITES conversations (the oldest dropped while Redis lags).
MAX_CONNECTIONS = 8
MAX_PENDING_WRITES = 4096


@dataclass
class _Lane:
    """Redis as one event loop uses it (redis.asyncio's connections belong to
    the loop that made them)."""

    client: aioredis.Redis
    pending: deque = field(default_factory=lambda: deque(maxlen=MAX_PENDING_WRITES))
    writer: asyncio.Task | None = None
    tried: bool = False  # a lookup has ended on this loop (answered or not)


class SharedAffinity:
    """lookup() / remember(): this front's map, and Redis's when `url` is set."""

    def __init__(self, url: str = "", *, local: AffinityMap | None = None) -> None:
        self.url = url
        self.local = local if local is not None else AffinityMap()
        self._lanes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._down_until = 0.0
        self._down = False
        self._slow = 0  # lookups in a row that took too long

    @property
    def sharing(self) -> bool:
        """Whether Redis is asked now (set, and not left alone after a
        failure)."""
        return bool(self.url) and time.monotonic() >= self._down_until

    def _lane(self) -> _Lane | None:
        if not self.sharing:
            return None
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(loop)
        if lane is None:
            pool = aioredis.BlockingConnectionPool.from_url(
                self.url,
                max_connections=MAX_CONNECTIONS,
                timeout=LOOKUP_TIMEOUT_S,
                socket_connect_timeout=CONNECT_TIMEOUT_S,
            )
            lane = self._lanes[loop] = _Lane(aioredis.Redis(connection_pool=pool))
        return lane

    def _failed(self, error: BaseException) -> None:
        if isinstance(error, TimeoutError):
            self._slow += 1
            if self._slow < SLOW_LOOKUPS_DOWN:
                return
            error = TimeoutError(f"{self._slow} lookups over {LOOKUP_TIMEOUT_S} s")
        self._slow = 0
        self._down_until = time.monotonic() + RETRY_AFTER_S
        if not self._down:
            self._down = True
            log.warning(
                "shared prompt-cache affinity unavailable (%s: %s): routing on "
                "this front's own map; retrying every %g s",
                type(error).__name__,
                error,
                RETRY_AFTER_S,
            )

    def _worked(self) -> None:
        self._slow = 0
        if self._down:
            self._down = False
            log.warning("shared prompt-cache affinity available again")

    async def lookup(
        self,
        keys: Sequence[str],
        engines: Mapping[str, EngineStatus],
        *,
        shared: bool = True,
    ) -> str:
        """The engine of the longest of `keys` remembered by any front (or,
        without Redis, by this one), if it is the same start of it as now
        (`engines`: the snapshot's); "" for none. `shared`: ask Redis."""
        if not keys:
            return ""
        lane = self._lane() if shared else None
        if lane is not None:
            bound = LOOKUP_TIMEOUT_S if lane.tried else CONNECT_TIMEOUT_S
            try:
                async with asyncio.timeout(bound):
                    values = await lane.client.mget([KEY_PREFIX + key for key in keys])
            except (RedisError, OSError, TimeoutError) as error:
                lane.tried = True
                self._failed(error)
            else:
                lane.tried = True
                self._worked()
                for value in values:
                    engine = _current(value, engines)
                    if engine:
                        return engine
        return _current(self.local.lookup(keys), engines)

    def remember(
        self, keys: Sequence[str], engine: EngineStatus, *, shared: bool = True
    ) -> None:
        """These prefixes were just sent to `engine`: in this front's map now,
        and (`shared`) in Redis by this loop's writer task, off the request's
        path."""
        if not keys:
            return
        value = f"{engine.name} {engine.incarnation}"
        self.local.remember(keys, value)
        lane = self._lane() if shared else None
        if lane is None:
            return
        lane.pending.append((tuple(dict.fromkeys((keys[0], keys[-1]))), value))
        if lane.writer is None or lane.writer.done():
            lane.writer = asyncio.ensure_future(self._write(lane))

    async def _write(self, lane: _Lane) -> None:
        """Write what is queued, a batch per round trip, until none is left."""
        while lane.pending:
            batch = [lane.pending.popleft() for _ in range(min(256, len(lane.pending)))]
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    async with lane.client.pipeline(transaction=False) as pipe:
                        for keys, value in batch:
                            for key in keys:
                                pipe.set(KEY_PREFIX + key, value, ex=TTL_S)
                        await pipe.execute()
            except (RedisError, OSError, TimeoutError) as error:
                self._failed(error)
                lane.pending.clear()  # routing goes on on this front's map
                return

    async def settled(self) -> None:
        """Wait until this loop's writes are done: a front stopping
        (roundhouse.asgi's lifespan), a test before another front looks."""
        lane = self._lanes.get(asyncio.get_running_loop())
        while lane is not None and lane.writer is not None and not lane.writer.done():
            await asyncio.shield(lane.writer)


def _current(value: str | bytes | None, engines: Mapping[str, EngineStatus]) -> str:
    """The engine a remembered value names, if that start of it runs now."""
    if not value:
        return ""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    name, _, incarnation = value.partition(" ")
    engine = engines.get(name)
    return name if engine is not None and engine.incarnation == incarnation else ""
