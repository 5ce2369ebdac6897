"""The reliability bench's report: the table of scenarios (requests by how
they ended, latency, recovery, leases and memory after), each scenario's notes,
the logs' error lines, and every request as JSON (`--keep`)."""

import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import (  # noqa: E402
    ERROR,
    HUNG_UP,
    LOST,
    RATE_LIMITED,
    SUCCEEDED,
    Result,
)


def percentile(values: list[float], fraction: float) -> float:
    return values[min(len(values) - 1, int(fraction * len(values)))]


def report(results: list[Result]) -> None:
    """The table, one row per scenario, then each scenario's notes."""
    header = (
        f"{'scenario':<34}{'requests':>9}{'ok':>6}{'429':>6}{'errors':>7}"
        f"{'lost':>6}{'hung up':>8}{'p50 ms':>8}{'p99 ms':>8}{'recovery s':>11}"
        f"  {'leases after':<16}{'RSS vs idle':<12}"
    )
    print()
    print(header)
    for result in results:
        latencies = result.latencies_ms()
        p50 = f"{percentile(latencies, 0.5):.0f}" if latencies else "-"
        p99 = f"{percentile(latencies, 0.99):.0f}" if latencies else "-"
        if result.fault_at is None or not result.failed:
            recovery = "-"
        elif result.recovery_s is None:
            recovery = "n/r"
        else:
            recovery = f"{result.recovery_s:.1f}"
        print(
            f"{result.name:<34}{len(result.outcomes):>9}{result.count(SUCCEEDED):>6}"
            f"{result.count(RATE_LIMITED):>6}{result.count(ERROR):>7}"
            f"{result.count(LOST):>6}{result.count(HUNG_UP):>8}{p50:>8}{p99:>8}"
            f"{recovery:>11}  {result.leases:<16}{result.rss:<12}"
        )
    print(
        "recovery: from the fault until the first request started after the last "
        "failed one succeeded; '-' nothing failed, 'n/r' not recovered"
    )
    print("notes:")
    for result in results:
        details = Counter(
            f"{o.kind} {o.detail}".strip()
            for o in result.outcomes
            if o.kind not in (SUCCEEDED,)
        )
        seen = ", ".join(f"{what} x{n}" for what, n in details.most_common())
        lines = [*result.notes, *([f"not succeeded: {seen}"] if seen else [])]
        for line in lines:
            print(f"  {result.name}: {line}")


def log_summary(run_dir: Path) -> None:
    """Error lines per log: where to look (`--keep` keeps them)."""
    for path in sorted((run_dir / "logs").glob("*.log")):
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        errors = [line for line in text if " ERROR " in line or "Traceback" in line]
        warnings = sum(" WARNING " in line for line in text)
        print(f"  log {path.name}: {len(errors)} error lines, {warnings} warnings")
        for line in errors[-3:]:
            print(f"    {line[:160]}")


def dump(results: list[Result], path: Path) -> None:
    """Every request of every scenario, in wall-clock seconds (to match the
    logs' timestamps) and relative to the fault."""
    offset = time.time() - time.monotonic()
    scenarios = []
    for result in results:
        base = result.fault_at or min(o.started for o in result.outcomes)

        def rel(moment: float | None, base: float = base) -> float | None:
            return None if moment is None else round(moment - base, 3)

        scenarios.append(
            {
                "name": result.name,
                "fault_at": result.fault_at and result.fault_at + offset,
                "requests": [
                    {
                        "started": rel(o.started),
                        "headers": rel(o.headers),
                        "first_token": rel(o.first_token),
                        "ended": rel(o.ended),
                        "kind": o.kind,
                        "detail": o.detail,
                    }
                    for o in result.outcomes
                ],
            }
        )
    path.write_text(json.dumps(scenarios, indent=1))
