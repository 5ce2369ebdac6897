"""Relay flood: what anyone who reaches a node's relay port does to the node.

Run (as root: it makes network namespaces):
    .venv/bin/python bench/relay_flood.py [--connections 500] [--streams 20]
      [--postgres postgres://postgres@127.0.0.1:5432]
or as the `relay_flood` scenario of bench/reliability.py.

Builds the two-node cluster of bench/cluster.py (nodes a and b in network
namespaces, TLS links, each node's supervisor with its relay and one engine,
a front on each). A client streams smol-b through front a, one greedy
16-token answer after another: every request crosses the link from front a to
node b's relay. First without the flood (the anchor), then while
--connections unauthenticated connections are held open against b's relay
from as many source addresses as --addresses (aliases on the bridge): each
connects, says nothing, and, once the relay closes it, connects again
--reconnect-s later (default 1 s: an attacker holding connections open, not
a connect storm; the attacker runs on the same two cores as the cluster, so
a faster storm measures the attacker's own CPU as much as the relay).
Reported: the client's p50 and p99 time to first token in both phases and
their ratio (goal: at most 1.5x), how many connections the flood had open at
most and how many the relay closed, and afterwards whether node
b's supervisor and engine are alive and its heartbeat current (node status
ready, engine eb ready).

Every loop is bounded in count and time; the namespaces, aliases and the
database are removed at the end, however the run ends.
"""

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

from bench.cluster import BenchCluster, prompt, stream_ttft  # noqa: E402
from tests.cluster.netns import netns_available  # noqa: E402

GOAL_RATIO = 1.5
TOKENS = 16
HELD_AT_MOST_S = 30.0  # one connection of the flood waits this long at most


@dataclass
class Flood:
    """Idle connections to one relay, kept up until `stop` is set."""

    host: str
    port: int
    sources: list[str]
    connections: int
    reconnect_s: float
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    open_now: int = 0
    open_most: int = 0
    made: int = 0
    closed_by_relay: int = 0
    failed: int = 0

    async def attacker(self, source: str) -> None:
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        self.host, self.port, local_addr=(source, 0)
                    ),
                    5,
                )
            except (OSError, TimeoutError):
                self.failed += 1
                await asyncio.sleep(self.reconnect_s)
                continue
            self.made += 1
            self.open_now += 1
            self.open_most = max(self.open_most, self.open_now)
            try:
                closing = asyncio.ensure_future(reader.read())
                stopping = asyncio.ensure_future(self.stop.wait())
                await asyncio.wait(
                    {closing, stopping},
                    timeout=HELD_AT_MOST_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if closing.done():
                    self.closed_by_relay += 1
                for task in (closing, stopping):
                    task.cancel()
            finally:
                self.open_now -= 1
                writer.close()
            await asyncio.sleep(self.reconnect_s)

    async def run(self) -> None:
        await asyncio.gather(
            *(
                self.attacker(self.sources[index % len(self.sources)])
                for index in range(self.connections)
            )
        )


async def ttfts(cluster: BenchCluster, count: int, offset: int) -> list[float]:
    """TTFT (ms) of `count` streams of smol-b through front a, one at a time."""
    host = cluster.hosts["a"].address
    times = []
    for index in range(count):
        started, _, node = await stream_ttft(
            host, cluster.key, "smol-b", prompt(index, offset + index), TOKENS
        )
        assert node in (None, "b"), node
        times.append(started * 1000)
    return times


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(cluster: BenchCluster, args, relay: tuple[str, int]) -> dict:
    await ttfts(cluster, 3, 1000)  # warm: the link made, the prompt path hot
    anchor = await ttfts(cluster, args.streams, 0)
    prefix = cluster.network.prefix
    sources = [f"{prefix}.{100 + index}" for index in range(args.addresses)]
    flood = Flood(relay[0], relay[1], sources, args.connections, args.reconnect_s)
    flooding = asyncio.ensure_future(flood.run())
    try:
        await asyncio.sleep(3)  # let it reach its full size
        flooded = await ttfts(cluster, args.streams, 100)
        held_during = flood.open_now
    finally:
        flood.stop.set()
        await asyncio.wait_for(flooding, HELD_AT_MOST_S + 10)
    return {
        "anchor": anchor,
        "flooded": flooded,
        "flood": flood,
        "held_during": held_during,
    }


def alive(cluster: BenchCluster) -> dict:
    """Node b after the flood: its processes, its row, its engine's."""
    from django.db import connection

    from fleet.models import EngineState

    supervisor = cluster.nodes["b"]["supervisor"]
    state = EngineState.objects.get(spec__name="eb")
    connection.close()
    return {
        "supervisor running": supervisor.poll() is None,
        "node b status": cluster.node_status("b"),
        "engine eb status": state.status,
    }


def report(result: dict, after: dict, args) -> None:
    anchor, flooded, flood = result["anchor"], result["flooded"], result["flood"]
    print(
        f"\nRelay flood: {args.connections} idle connections from "
        f"{args.addresses} addresses against node b's relay, while one client "
        f"streams smol-b through front a ({args.streams} streams per phase, "
        f"{TOKENS} tokens; a closed connection reconnects {args.reconnect_s:g} s "
        "later)"
    )
    print(f"{'phase':<14} {'TTFT p50 ms':>12} {'p99 ms':>8}")
    for name, values in (("no flood", anchor), ("flood", flooded)):
        print(f"{name:<14} {statistics.median(values):>12.1f} {p(values, 0.99):>8.1f}")
    ratio = statistics.median(flooded) / statistics.median(anchor)
    verdict = "MET" if ratio <= GOAL_RATIO else "NOT MET"
    print(f"flood / no flood (p50): {ratio:.2f}x (goal <= {GOAL_RATIO:g}x: {verdict})")
    print(
        f"flood: {flood.made} connections made, {flood.closed_by_relay} closed by "
        f"the relay, {flood.failed} failed to connect; open at most "
        f"{flood.open_most}, {result['held_during']} when the flooded phase ended"
    )
    for name, value in after.items():
        print(f"afterwards, {name}: {value}")


def run(postgres: str, args) -> None:
    why = netns_available()
    if why:
        print(f"relay flood skipped: {why}")
        return
    with tempfile.TemporaryDirectory(prefix="rh-bench-flood-") as tmp:
        cluster = BenchCluster(postgres, Path(tmp))
        try:
            cluster.start()
            network = cluster.network
            for index in range(args.addresses):
                subprocess.run(
                    ["ip", "addr", "add", f"{network.prefix}.{100 + index}/24"]
                    + ["dev", network.bridge],
                    check=True,
                )
            from cluster.selectors import nodes_now

            b = nodes_now()["b"]
            result = asyncio.run(measure(cluster, args, (b.address, b.relay_port)))
            time.sleep(3)  # a heartbeat or more after the flood
            after = alive(cluster)
        finally:
            cluster.close()
    report(result, after, args)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--addresses", type=int, default=100)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--reconnect-s", type=float, default=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments(parser)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432")
    args = parser.parse_args()
    run(args.postgres, args)


if __name__ == "__main__":
    main()
