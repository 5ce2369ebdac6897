"""A node's own links to the other nodes' relays, reckoned every second
by its supervisor (membership.py), to learn which peers it reaches: what it
writes with its heartbeat (`reaches`: how long each link has failed; the
cluster takes a node every other node fails to link to for unreachable,
cluster/selectors.py), and, through a database outage, whether the outage is
everyone's (cluster/peers_reached.py).

The links are kept open between rounds (their keepalive notices a silent
peer within LINK_DEAD_S), so a round costs a connection only for a peer
whose link was lost. The rounds run on the relay's event loop, every second
(membership.PEER_ROUND_S) whether the database answers or not; the
heartbeat thread hands in the peers of its last view and reads `reckoning`,
each replaced whole.
"""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from node_link.client import LinkPool, Peer
from node_link.protocol import LinkRefused

from cluster.peers_reached import PeersReached

from .loop_errors import LoopErrors

# A round waits this long at most for a peer's link (connect, TLS, hello);
# the peers are tried at once, so a round lasts no longer than that.
TRY_S = 1.5


@dataclass(frozen=True)
class Reckoning:
    """One round's outcome: for each peer tried, how long its link has
    failed (0: linked now), and of those linked, the ones whose relay said it
    reaches the database."""

    failing_s: dict[str, float] = field(default_factory=dict)
    database: frozenset[str] = frozenset()
    counted: frozenset[str] = frozenset()  # the peers that count (serving)
    started_at: float = -float("inf")  # time.monotonic() when the round began

    def peers_reached(self) -> PeersReached:
        linked = {
            name
            for name in self.counted
            if name in self.failing_s and self.failing_s[name] == 0
        }
        return PeersReached(
            at=time.monotonic(),
            peers=len(self.counted),
            reached=len(linked),
            database=len(linked & self.database),
        )


class PeerLinks:
    """want() each heartbeat (from its thread); run() on the relay's loop
    makes a round every `every_s`, database or not, and hands each
    reckoning to `reckoned` (also in `reckoning`)."""

    def __init__(self, pool: LinkPool) -> None:
        self._pool = pool
        # Peer -> when (time.monotonic()) it was first tried, and last linked.
        self._first_tried: dict[str, float] = {}
        self._linked_at: dict[str, float] = {}
        # Peer -> the node it was when those were taken.
        self._peers: dict[str, Peer] = {}
        # The peers of the last view (replaced whole by want()).
        self._wanted: tuple[tuple[Peer, ...], frozenset[str]] = ((), frozenset())
        # Links failing before this (time.monotonic()) are not counted: this
        # node could not reach the database then, so its own network was in
        # doubt (set by count_from_now()).
        self._counting_since = -float("inf")
        self.reckoning = Reckoning()

    def want(self, peers: list[Peer], counted: set[str]) -> None:
        """The peers to link to from now on (`counted`: those of them that
        were serving); kept through a database outage."""
        self._wanted = (tuple(peers), frozenset(counted))

    def count_from_now(self) -> None:
        """Count links failing from now on only (from the heartbeat thread,
        when this node reaches the database again after an outage). A node
        cut off from the network fails to link to everyone; once back, what
        it reports of its peers must be what it finds from then on, not the
        time it was cut off: else it takes its healthy peers for unreachable
        (the cluster counts a node every other node fails to link to as
        unreachable) until its links are made again."""
        self._counting_since = time.monotonic()

    def reported(self) -> dict[str, float]:
        """What this node says of its links now (its heartbeat's `reaches`):
        the last round's failures, or nothing while that round began before
        count_from_now()."""
        reckoning = self.reckoning
        if reckoning.started_at < self._counting_since:
            return {}
        return reckoning.failing_s

    async def run(
        self,
        every_s: float,
        reckoned: Callable[[Reckoning], Awaitable[None]],
        errors: LoopErrors,
    ) -> None:
        """Rounds for ever, each starting `every_s` after the last; any
        error of one round is recorded in `errors` and the next comes."""
        while True:
            started = time.monotonic()
            try:
                self.reckoning = await self.round(*self._wanted)
                await reckoned(self.reckoning)
            except Exception as error:  # noqa: BLE001 - that round alone
                errors.failed("peer links", error)
            else:
                errors.cleared("peer links")
            await asyncio.sleep(max(every_s - (time.monotonic() - started), 0.1))

    async def round(
        self, peers: tuple[Peer, ...], counted: frozenset[str]
    ) -> Reckoning:
        """Try every peer at once (each for TRY_S at most)."""
        # A peer gone from the view, or back under its name as another node
        # (a new address or certificate: it joined again), starts anew.
        started = time.monotonic()
        current = {peer.node: peer for peer in peers}
        for name in set(self._first_tried):
            if self._peers.get(name) != current.get(name):
                self._first_tried.pop(name, None)
                self._linked_at.pop(name, None)
        self._peers = current
        outcomes = await asyncio.gather(*(self._try(peer) for peer in peers))
        now = time.monotonic()
        failing, database = {}, set()
        for peer, outcome in zip(peers, outcomes, strict=True):
            if outcome is None:
                since = max(
                    self._linked_at.get(peer.node, -float("inf")),
                    self._first_tried[peer.node],
                    self._counting_since,
                )
                failing[peer.node] = round(max(now - since, 0.001), 3)
            else:
                failing[peer.node] = 0
                if outcome:
                    database.add(peer.node)
        return Reckoning(
            failing_s=failing,
            database=frozenset(database),
            counted=counted,
            started_at=started,
        )

    async def _try(self, peer: Peer) -> bool | None:
        """Whether the peer, linked now, reaches the database (None: no link)."""
        self._first_tried.setdefault(peer.node, time.monotonic())
        try:
            link = await asyncio.wait_for(self._pool.link(peer), TRY_S)
        except (OSError, TimeoutError, LinkRefused):
            return None
        except Exception:  # noqa: BLE001 - anything else: not linked, this round
            return None
        if not link.alive:
            return None
        self._linked_at[peer.node] = time.monotonic()
        return link.peer_database is not False

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._pool.close()
