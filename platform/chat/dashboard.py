"""The fleet dashboard's live feed (`/ws/dashboard/`, staff only).

While any dashboard is open, one task per front process reads the fleet from
the database about once a second (fleet.selectors.fleet_overview, one query
for engines and states, one for models) and sends it to the `fleet-dashboard`
group over the channel layer; each dashboard socket in the group forwards it.
With a shared cache and channels_redis (REDIS_URL), front processes take a
lease in the cache so that only one of them reads and sends at a time; with
the in-memory defaults each process feeds its own sockets.

Each update carries a sample per engine (tokens/s from the engine's token
counter, queue depth, memory), kept for the last HISTORY_S seconds so that a
dashboard opened now starts with the last minutes charted.

Beside the engines, the fleet sent (dashboard_fleet) carries each node's disk
for models (fleet/disk.py: from its heartbeat, or this host's own on one host,
measured at most every 30 s) and the model pulls in progress: one more small
query each, once a second.
"""

import asyncio
import json
import logging
import secrets
import time
from collections import deque

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import get_channel_layer
from django.core.cache import cache

from api.calls import spawn
from api.parts import Part
from catalog.models import PULL_OPEN, ModelPull
from catalog.pull_progress import pulls_with_db_now, rate_now, stalled_s
from fleet.disk import disks_overview
from fleet.selectors import fleet_overview

log = logging.getLogger("roundhouse.chat")

GROUP = "fleet-dashboard"
INTERVAL_S = 1.0
HISTORY_S = 600
# The cache key of the lease to read and send the fleet, and its length.
LEASE_KEY = "dashboard:feed"
LEASE_S = 3
FORBIDDEN = 4403


def pulls_in_progress() -> list[dict]:
    """The model pulls queued or running, oldest first: name, node, status,
    bytes done of the size, percent, rate (bytes/s) and seconds left as they
    are now, and for how long no bytes came once it has stalled (else None)."""
    rows = pulls_with_db_now(ModelPull.objects.filter(status__in=PULL_OPEN))
    pulls = []
    for pull in rows.order_by("created_at"):
        rate, left = rate_now(pull)
        quiet = stalled_s(pull)
        pulls.append(
            {
                "name": pull.name,
                "source": pull.source,
                "node": pull.node,
                "status": pull.status,
                "done_bytes": pull.done_bytes,
                "size_bytes": pull.size_bytes,
                "percent": round(100 * pull.fraction, 1),
                "rate_bps": rate,
                "left_s": left,
                "stalled_s": None if quiet is None else round(quiet),
            }
        )
    return pulls


def dashboard_fleet() -> dict:
    """What the dashboard shows (JSON-ready): the fleet (fleet_overview), the
    disks for models (each node's, or this host's) and the pulls in
    progress."""
    return {
        **fleet_overview(),
        "disks": disks_overview(),
        "pulls": pulls_in_progress(),
    }


class FleetFeed:
    """Reads the fleet and sends it to the dashboards, while any watches."""

    def __init__(self) -> None:
        self.watchers = 0
        self.samples: deque[dict] = deque(maxlen=int(HISTORY_S / INTERVAL_S))
        self.last: dict | None = None
        self._task: asyncio.Task | None = None
        self._soon = asyncio.Event()
        self._token = secrets.token_hex(8)
        self._counted: dict[str, tuple[float, int]] = {}  # engine -> (t, tokens)

    def watch(self) -> None:
        self.watchers += 1
        task = self._task
        if (
            task is None
            or task.done()
            # One left on another event loop (a test's, since closed).
            or task.get_loop() is not asyncio.get_running_loop()
        ):
            self._soon = asyncio.Event()
            self._task = spawn(self._run(), "feeding the fleet dashboard")

    def unwatch(self) -> None:
        self.watchers = max(0, self.watchers - 1)

    def poke(self) -> None:
        """Send the fleet now (an operator just acted), not in a second."""
        self._soon.set()

    def remember(self, sample: dict) -> None:
        """Keep a sample (each socket of this process hands it over: once)."""
        if not self.samples or self.samples[-1].get("at") != sample.get("at"):
            self.samples.append(sample)

    async def _run(self) -> None:
        while self.watchers > 0:
            try:
                layer = get_channel_layer()
                if await self._leased():
                    fleet = await database_sync_to_async(dashboard_fleet)()
                    self.last = fleet
                    await layer.group_send(
                        GROUP,
                        {
                            "type": "fleet.update",
                            "fleet": fleet,
                            "sample": self._sample(fleet),
                        },
                    )
            except Exception as error:  # the database may be down: try again
                log.warning("could not read the fleet for the dashboard: %s", error)
            try:
                async with asyncio.timeout(INTERVAL_S):
                    await self._soon.wait()
            except TimeoutError:
                pass
            self._soon.clear()
        if await self._held():  # let another process take over at once
            await cache.adelete(LEASE_KEY)

    async def _leased(self) -> bool:
        """Whether this process reads and sends the fleet now (its lease in
        the shared cache, taken or renewed)."""
        if await cache.aadd(LEASE_KEY, self._token, timeout=LEASE_S):
            return True
        if await self._held():
            await cache.atouch(LEASE_KEY, timeout=LEASE_S)
            return True
        return False

    async def _held(self) -> bool:
        return await cache.aget(LEASE_KEY) == self._token

    def _sample(self, fleet: dict) -> dict:
        """One chart point per engine: tokens/s since the last read, queue
        depth, memory (the engine's RSS)."""
        now = time.time()
        points = {}
        for engine in fleet["engines"]:
            tokens = int(engine["tokens_generated"] or 0)
            before = self._counted.get(engine["name"])
            rate = 0.0
            if before is not None and now > before[0] and tokens >= before[1]:
                rate = (tokens - before[1]) / (now - before[0])
            self._counted[engine["name"]] = (now, tokens)
            points[engine["name"]] = {
                "t": round(now, 3),
                "tokens_per_s": round(rate, 2),
                "queue": engine["queue_depth"],
                "memory_mib": engine["memory_mib"],
            }
        return {"at": round(now, 3), "engines": points}


# The front's fleet feed (api.parts): built when the front starts, never at
# import.
fleet_feed: Part[FleetFeed] = Part(FleetFeed)


class DashboardConsumer(AsyncWebsocketConsumer):
    """A staff member's dashboard: the fleet at once, then every update."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.watching = False
        if user is None or not (user.is_authenticated and user.is_staff):
            await self.accept()
            await self.close(code=FORBIDDEN, reason="The dashboard is for staff.")
            return
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()
        self.watching = True
        feed = fleet_feed()
        feed.watch()
        fleet = feed.last or await database_sync_to_async(dashboard_fleet)()
        await self._send(
            {"type": "fleet", "fleet": fleet, "history": list(feed.samples)}
        )

    async def fleet_update(self, event: dict) -> None:
        fleet_feed().remember(event["sample"])
        await self._send(
            {"type": "fleet", "fleet": event["fleet"], "sample": event["sample"]}
        )

    async def fleet_notice(self, event: dict) -> None:
        await self._send(
            {"type": "notice", "text": event["text"], "level": event["level"]}
        )

    async def receive(self, text_data=None, bytes_data=None) -> None:
        pass  # the dashboard only listens; its orders are CSRF-checked POSTs

    async def _send(self, message: dict) -> None:
        await self.send(text_data=json.dumps(message, separators=(",", ":")))

    async def disconnect(self, code: int) -> None:
        if self.watching:
            self.watching = False
            fleet_feed().unwatch()
            await self.channel_layer.group_discard(GROUP, self.channel_name)


async def dashboard_notice(text: str, *, level: str = "info") -> None:
    """Tell every open dashboard (an order's outcome), and send the fleet."""
    await get_channel_layer().group_send(
        GROUP, {"type": "fleet.notice", "text": text, "level": level}
    )
    fleet_feed().poke()
