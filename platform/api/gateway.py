"""How the front reaches engines: a routing snapshot at most a second old, the
router's choice, and a client built from the engine's connection file."""

import dataclasses

from asgiref.sync import sync_to_async
from django.conf import settings

from engines.client import AsyncEngineClient
from fleet.selectors import routing_snapshot
from routing.select import Choice, ModelRoute, Router, Snapshot, SnapshotCache


class Gateway:
    """The front's one router and snapshot cache (shared by every request)."""

    def __init__(self) -> None:
        self.router = Router()
        self.cache = SnapshotCache(routing_snapshot, max_age_s=1.0)

    async def snapshot(self) -> Snapshot:
        """The cached snapshot; the database is read at most once a second."""
        fresh = self.cache.fresh()
        if fresh is not None:  # the common case: no thread hop at all
            return fresh
        return await sync_to_async(self.cache.get)()

    def choose(
        self, model: ModelRoute, snapshot: Snapshot, *, excluding: set[str]
    ) -> Choice:
        """The router's choice, with engines that just failed taken for down."""
        if excluding:
            engines = {
                name: dataclasses.replace(engine, up=False)
                if name in excluding
                else engine
                for name, engine in snapshot.engines.items()
            }
            snapshot = dataclasses.replace(snapshot, engines=engines)
        return self.router.choose(model, snapshot)

    def client(self, engine: str) -> AsyncEngineClient:
        """A client for a supervised engine (raises OSError without its file)."""
        return AsyncEngineClient.for_engine(settings.RUN_DIR, engine)


GATEWAY = Gateway()
