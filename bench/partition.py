"""Partition: how fast a node cut off from the cluster stops answering its own
clients, and how fast each refusal comes (issue 31, point 20).

Run (as root: it makes network namespaces):
    .venv/bin/python bench/partition.py [--every-s 0.5] [--seconds 20]
      [--postgres postgres://postgres@127.0.0.1:5432]

Builds the two-node cluster of bench/cluster.py (nodes a and b in network
namespaces, TLS links, each node's supervisor and a front). A client on b's
own host (its loopback: a client beside the node) asks b's front for a
greedy smol-b answer once, so that b knows the key, then node b is cut off
with iptables DROP (alive, reaching neither the database nor the other node,
as tests/cluster/test_node_failure.py cuts it) and the same client sends a
request every --every-s for --seconds, each on its own connection, without
waiting for the previous ones (each waits 30 s at most).

Reported: the time from the cut to the first `503 cluster_unconfirmed`
(the moment its answer arrived; goal: at most 6 s, the view's age after
which a front refuses), the refusals' latency p50 and max (goal: fast, from
memory, not the 9-10 s of a database load each), how many requests were
still served after the cut, refused otherwise, or unanswered.
Before issue 31 the first refusal came 13 s after the cut and each took 9-10
s. Every loop is bounded; the namespaces and the database are removed at the
end, however the run ends.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

from bench.cluster import BenchCluster  # noqa: E402
from tests.cluster.netns import netns_available  # noqa: E402

GOAL_FIRST_REFUSAL_S = 6.0
ANSWER_WAIT_S = 30.0

# Run on b's host: one request every EVERY seconds for SECONDS, each in its
# own thread; one JSON line per request (sent and answered by the monotonic
# clock, which the namespaces share with this process).
CLIENT = """
import json, sys, threading, time, urllib.error, urllib.request
key = sys.argv[1]
every, seconds, wait = map(float, sys.argv[2:5])
body = json.dumps({"model": "smol-b", "messages": [{"role": "user", "content": "Hi"}],
                   "max_tokens": 4, "temperature": 0}).encode()
lock = threading.Lock()

def ask():
    sent = time.monotonic()
    request = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions",
        data=body, headers={"Content-Type": "application/json",
                            "Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(request, timeout=wait) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    except OSError as error:
        status, text = 0, str(error)
    try:
        code = (json.loads(text).get("error") or {}).get("code", "")
    except ValueError:
        code = ""
    with lock:
        print(json.dumps({"sent": sent, "answered": time.monotonic(),
                          "status": status, "code": code}), flush=True)

threads = []
start = time.monotonic()
for index in range(int(seconds / every)):
    time.sleep(max(0.0, start + index * every - time.monotonic()))
    thread = threading.Thread(target=ask)
    thread.start()
    threads.append(thread)
for thread in threads:
    thread.join()
"""


def ask_from_b(cluster: BenchCluster, every_s: float, seconds: float) -> list[dict]:
    host = cluster.hosts["b"]
    done = host.run(
        [sys.executable, "-c", CLIENT, cluster.key]
        + [str(every_s), str(seconds), str(ANSWER_WAIT_S)],
        timeout=seconds + ANSWER_WAIT_S + 30,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the client on b failed: {done.stderr[-500:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line]


def measure(cluster: BenchCluster, args) -> dict:
    warm = ask_from_b(cluster, 1.0, 1.0)  # b's front knows the key
    if [answer["status"] for answer in warm] != [200]:
        raise RuntimeError(f"b did not serve before the cut: {warm}")
    host = cluster.hosts["b"]
    host.cut_off()
    try:
        cut_at = time.monotonic()
        answers = ask_from_b(cluster, args.every_s, args.seconds)
    finally:
        host.reconnect()
    return {"cut_at": cut_at, "answers": answers}


def report(result: dict, args) -> None:
    cut_at, answers = result["cut_at"], result["answers"]
    refusals = [
        a for a in answers if a["status"] == 503 and a["code"] == "cluster_unconfirmed"
    ]
    served = [a for a in answers if a["status"] == 200]
    unanswered = [a for a in answers if a["status"] == 0]
    other = len(answers) - len(refusals) - len(served) - len(unanswered)
    print(
        f"\nPartition: node b cut off (iptables DROP); a client on b's host asks "
        f"b's front for smol-b every {args.every_s:g} s for {args.seconds:g} s "
        f"({len(answers)} requests, each waiting {ANSWER_WAIT_S:g} s at most)"
    )
    if refusals:
        first = min(a["answered"] for a in refusals) - cut_at
        latencies = [a["answered"] - a["sent"] for a in refusals]
        verdict = "MET" if first <= GOAL_FIRST_REFUSAL_S else "NOT MET"
        print(
            f"first 503 cluster_unconfirmed {first:.1f} s after the cut "
            f"(goal <= {GOAL_FIRST_REFUSAL_S:g} s: {verdict})"
        )
        print(
            f"refusal latency: p50 {statistics.median(latencies) * 1000:.0f} ms, "
            f"max {max(latencies) * 1000:.0f} ms ({len(refusals)} refusals)"
        )
    else:
        print("no 503 cluster_unconfirmed at all (NOT MET)")
    if served:
        last = max(a["answered"] for a in served) - cut_at
        print(f"served after the cut: {len(served)} (the last {last:.1f} s after it)")
    print(f"unanswered within {ANSWER_WAIT_S:g} s: {len(unanswered)}; other: {other}")
    print("each request (sent after the cut s, latency s, status, code):")
    for a in sorted(answers, key=lambda a: a["sent"]):
        print(
            f"  {a['sent'] - cut_at:6.2f} {a['answered'] - a['sent']:6.2f} "
            f"{a['status']} {a['code']}"
        )


def run(postgres: str, args) -> None:
    why = netns_available()
    if why:
        print(f"partition skipped: {why}")
        return
    with tempfile.TemporaryDirectory(prefix="rh-bench-partition-") as tmp:
        cluster = BenchCluster(postgres, Path(tmp))
        try:
            cluster.start()
            result = measure(cluster, args)
        finally:
            cluster.close()
    report(result, args)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--every-s", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=20.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments(parser)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432")
    args = parser.parse_args()
    run(args.postgres, args)


if __name__ == "__main__":
    main()
