"""Shared prompt-cache affinity: what a lookup in Redis costs a request,
against the front's own map (the anchor), in the same run.

Run (Redis on 127.0.0.1:6379, as the tests use; database 4 is written):
    .venv/bin/python bench/affinity.py [--lookups 2000] [--turns 8]

Each lookup is of a conversation of --turns turns (its prefix keys, as the
front computes them: routing.affinity.prefix_keys), half of them remembered
beforehand, the way a front looks a request up before it routes it. Printed:
p50 and p99 per lookup (microseconds) for the front's own map, for Redis
(platform/api/affinity.py, one MGET per lookup on one event loop), and the
difference: what sharing adds to a request's time to first token.
"""

import argparse
import asyncio
import secrets
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

from api.affinity import SharedAffinity  # noqa: E402
from routing.affinity import prefix_keys  # noqa: E402
from routing.select import EngineStatus  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/4"


def conversations(count: int, turns: int) -> list[tuple[str, ...]]:
    return [
        prefix_keys(
            "smol",
            [
                {"role": "user", "content": f"turn {turn} {secrets.token_hex(8)}"}
                for turn in range(turns * 2)
            ],
        )
        for _ in range(count)
    ]


async def timed(
    affinity: SharedAffinity, keys, engines, *, shared: bool
) -> list[float]:
    took = []
    for each in keys:
        started = time.perf_counter()
        await affinity.lookup(each, engines, shared=shared)
        took.append((time.perf_counter() - started) * 1e6)
    return took


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1]


async def main(lookups: int, turns: int) -> None:
    engines = {
        name: EngineStatus(name, "cpu", frozenset(), True, incarnation="t1")
        for name in ("ea", "eb")
    }
    affinity = SharedAffinity(REDIS_URL)
    keys = conversations(lookups, turns)
    for index, each in enumerate(keys[: lookups // 2]):
        affinity.remember(each, engines["ea" if index % 2 else "eb"])
    await affinity.settled()
    await timed(affinity, keys[:50], engines, shared=True)  # connect first
    rows = {
        "own map (anchor)": await timed(affinity, keys, engines, shared=False),
        "Redis (shared)": await timed(affinity, keys, engines, shared=True),
    }
    print(f"{lookups} lookups of {turns}-turn conversations (16 prefix keys at most)")
    print(f"{'lookup':<18} {'p50 us':>9} {'p99 us':>9}")
    for name, took in rows.items():
        print(f"{name:<18} {quantile(took, 0.5):>9.1f} {quantile(took, 0.99):>9.1f}")
    anchor, shared = rows["own map (anchor)"], rows["Redis (shared)"]
    added = quantile(shared, 0.5) - quantile(anchor, 0.5)
    print(
        f"sharing adds {added / 1000:.3f} ms per request at p50 "
        f"({quantile(shared, 0.5) / quantile(anchor, 0.5):.0f}x the own map's)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=8)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.lookups, arguments.turns))
