"""Cluster: what a hop to another node costs, what a second replica gives, and
how fast a model is served again when a node dies.

Run (as root: it makes network namespaces):
    .venv/bin/python bench/cluster.py [--rounds 5] [--streams 1 8] [--seconds 20]
      [--postgres postgres://postgres@127.0.0.1:5432]

Builds a two-host cluster on this machine as the multi-host tests do
(tests/cluster/netns.py: a bridge, one network namespace per host, PostgreSQL
and Redis reached through the bridge): nodes a and b join with their one-time
tokens on a fresh PostgreSQL database (created for the run, dropped at its
end); each runs `manage.py supervise --node` (its relay and one engine, ea
pinned to core 0, eb to core 1) and a front, with the platform's defaults
(TLS links with pinned certificates). SmolLM2-135M serves as three models:
smol-a on a only, smol-b on b only, smol-2 with a replica on each. Every
request goes to front a from this process, greedy chat answers.

1. Time to first token through a remote node against a local one: N
   concurrent streams (N = each of --streams) of smol-a (front a -> a's engine
   on a's loopback) and of smol-b (front a -> link -> b's relay -> b's
   engine), interleaved, --rounds rounds. The path's part of TTFT is the
   client's TTFT minus the engine's own (`timings.engine_first_token_ms`, from
   the request's arrival in the engine), which takes the prompt's compute out;
   p50 over the streams, median over the rounds. Goal: the remote path adds at
   most 3 ms to the local one (one hop).
2. Throughput: --clients client loops (default 8) asking for 64-token answers
   for --seconds each, from smol-a (one replica, one core) and from smol-2
   (two replicas on two nodes, each engine pinned to its own core): completion
   tokens per second. Goal: >= 1.8x.
3. Recovery: 4 client loops asking smol-2 (16-token answers) while every
   process of node b is SIGKILLed: requests lost (any that did not get a 200:
   none that had not started on b should be), the longest gap between two
   answers, when the cluster took b for unreachable and when it was down. Goal:
   served again within 15 s, no request lost. For scale: LocalAI measured 74 s
   for its own failover, and GPUStack marks a worker not ready after 150 s
   (their documentation; not measured here).

The fronts and this client share the machine's two cores with the engines:
the throughput anchor's second core is free for them, the two-replica run's
is not. Every loop is bounded; the namespaces and the database are removed at
the end, however the run ends.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

from tests.cluster.netns import (  # noqa: E402
    Network,
    netns_available,
    node_environment,
    start_node,
)

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS_DIR = Path(os.environ.get("ROUNDHOUSE_MODELS_DIR", ROOT / "var" / "models"))
FRONT_PORT = 8000
GOAL_HOP_MS = 3.0
GOAL_SPEEDUP = 1.8
GOAL_RECOVERY_S = 15.0
TOPICS = ["rivers", "bridges", "owls", "tea", "trains", "maps", "bees", "clocks"]


def prompt(index: int, round_: int) -> list[dict]:
    topic = TOPICS[index % len(TOPICS)]
    return [
        {
            "role": "user",
            "content": f"Write three sentences about {topic} (request {round_}).",
        }
    ]


# -- a small HTTP client (one connection per request, as most clients do) -----


async def post(host: str, body: dict, key: str):
    """(status, headers, reader, writer) of a POST to /v1/chat/completions."""
    reader, writer = await asyncio.open_connection(host, FRONT_PORT)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader, writer


async def stream_ttft(host: str, key: str, model: str, messages, tokens: int):
    """(client's TTFT s, engine's own TTFT s, node) of one streamed answer."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    status, headers, reader, writer = await post(host, body, key)
    if status != 200:
        raise RuntimeError(f"{model}: HTTP {status}: {(await reader.read())[:200]!r}")
    first, engine = None, 0.0
    try:
        while line := await reader.readline():
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{model}: {event['error']}")
            if "timings" in event:
                engine = (event["timings"]["engine_first_token_ms"] or 0) / 1000
            choices = event.get("choices") or [{}]
            if first is None and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - start
    finally:
        writer.close()
    return (
        first or time.perf_counter() - start,
        engine,
        headers.get("x-roundhouse-node"),
    )


async def answer(host: str, key: str, model: str, messages, tokens: int):
    """(status, completion tokens, node) of one whole answer."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
    }
    try:
        status, headers, reader, writer = await post(host, body, key)
        raw = await reader.read()
        writer.close()
    except OSError as error:
        return 0, 0, f"connection: {error}"
    if status != 200:
        return status, 0, raw[-300:].decode(errors="replace")
    text = raw.decode(errors="replace")
    reply = json.loads(text[text.index("{") : text.rindex("}") + 1])
    return status, reply["usage"]["completion_tokens"], headers.get("x-roundhouse-node")


# -- the cluster -------------------------------------------------------------------


class BenchCluster:
    """Nodes a and b on a fresh database; see the module's docstring."""

    def __init__(self, postgres: str, tmp: Path) -> None:
        self.postgres = postgres.rstrip("/")
        self.tmp = tmp
        self.database = f"rh_bench_cluster_{os.getpid()}"
        self.network = Network()
        self.nodes: dict[str, dict] = {}
        self.hosts = {}
        self.key = ""

    def psql(self, sql: str) -> None:
        subprocess.run(
            ["psql", f"{self.postgres}/postgres", "-q", "-c", sql],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        self.psql(f"CREATE DATABASE {self.database}")
        os.environ["DATABASE_URL"] = f"{self.postgres}/{self.database}"
        os.environ["ROUNDHOUSE_RUN_DIR"] = str(self.tmp / "bench-run")
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            check=True,
        )
        import django

        django.setup()
        from api.services import api_key_create
        from catalog.models import ModelConfig
        from cluster.models import ClusterSettings
        from cluster.services import node_create
        from fleet.models import EngineSpec

        ModelConfig.objects.all().delete()
        EngineSpec.objects.all().delete()
        settings_row = ClusterSettings.load()
        settings_row.grace_s = 5.0
        settings_row.save()
        for name, labels, replicas in (
            ("smol-a", ["zone-a"], 1),
            ("smol-b", ["zone-b"], 1),
            ("smol-2", [], 2),
        ):
            ModelConfig.objects.create(
                name=name,
                format="gguf",
                task="chat",
                path=MODEL_FILE,
                context_length=1024,
                replicas=replicas,
                node_labels=labels,
            )
        _, self.key = api_key_create(name="bench-cluster")
        self.network.open()
        tokens = {}
        for index, name in enumerate(("a", "b")):
            host = self.hosts[name] = self.network.add_host(name)
            node, tokens[name] = node_create(
                name=name, address=host.address, labels=[f"zone-{name}"]
            )
            EngineSpec.objects.create(
                name=f"e{name}",
                node=node,
                backend="cpu",
                capabilities=["gguf"],
                cpus=str(index),
            )
        redis_db = 8 + os.getpid() % 8
        # The hosts reach PostgreSQL through the bridge.
        bridged = self.postgres.replace("127.0.0.1", self.network.gateway)
        for name, host in self.hosts.items():
            run_dir = self.tmp / name / "run"
            run_dir.mkdir(parents=True, mode=0o700)
            env = node_environment(
                database_url=f"{bridged}/{self.database}",
                redis_url=f"redis://{self.network.gateway}:6379/{redis_db}",
                run_dir=run_dir,
                models_dir=MODELS_DIR,
                root=ROOT,
            )
            self.nodes[name] = start_node(
                host,
                name,
                env=env,
                log_dir=self.tmp,
                root=ROOT,
                join_token=tokens[name],
            )
        self.wait_resident({"ea": {"smol-a", "smol-2"}, "eb": {"smol-b", "smol-2"}})

    def wait_resident(self, wanted: dict[str, set[str]], timeout: float = 240) -> None:
        from fleet.models import EngineState

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = {
                state.spec.name: set(state.resident_model_names)
                for state in EngineState.objects.select_related("spec")
                if state.status == "ready"
            }
            if all(
                models <= held.get(engine, set()) for engine, models in wanted.items()
            ):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the cluster did not get ready; see the logs in {self.tmp}")

    def node_status(self, name: str) -> str:
        from django.db import connection

        from cluster.selectors import nodes_now

        status = str(nodes_now()[name].status)
        connection.close()
        return status

    def close(self) -> None:
        for host in self.hosts.values():
            host.stop_all(timeout=20)
        self.network.close()
        from django.db import connections

        connections.close_all()
        try:
            self.psql(f"DROP DATABASE IF EXISTS {self.database} WITH (FORCE)")
        except subprocess.CalledProcessError as error:
            print(f"could not drop {self.database}: {error.stderr!r}")


# -- phases ----------------------------------------------------------------------


async def ttft_phase(cluster: BenchCluster, counts: list[int], rounds: int) -> list:
    host = cluster.hosts["a"].address
    for model in ("smol-a", "smol-b"):  # warm: links made, models read once
        await stream_ttft(host, cluster.key, model, prompt(0, -1), 4)
    rows = []
    for count in counts:
        per_path: dict[str, list[tuple[float, float, float]]] = {
            "local": [],
            "remote": [],
        }
        for round_ in range(rounds):
            for path, model in (("local", "smol-a"), ("remote", "smol-b")):
                results = await asyncio.gather(
                    *(
                        stream_ttft(host, cluster.key, model, prompt(i, round_), 16)
                        for i in range(count)
                    )
                )
                nodes = {node for *_, node in results}
                expected = "a" if path == "local" else "b"
                if nodes != {expected}:
                    raise RuntimeError(f"{path} streams served by {nodes}")
                per_path[path].append(
                    (
                        statistics.median(t for t, _, _ in results),
                        statistics.median(e for _, e, _ in results),
                        statistics.median(t - e for t, e, _ in results),
                    )
                )
                await asyncio.sleep(0.3)
        for path, samples in per_path.items():
            rows.append(
                (
                    count,
                    path,
                    *(
                        statistics.median(s[k] for s in samples) * 1000
                        for k in range(3)
                    ),
                )
            )
    return rows


async def load(
    cluster: BenchCluster, model: str, clients: int, seconds: float, tokens: int
):
    """Client loops for `seconds`; every outcome (start, end, status, tokens, node)."""
    host = cluster.hosts["a"].address
    outcomes = []
    end = time.monotonic() + seconds

    async def client(index: int) -> None:
        n = 0
        while time.monotonic() < end:
            started = time.monotonic()
            status, count, node = await answer(
                host, cluster.key, model, prompt(index, n), tokens
            )
            outcomes.append((started, time.monotonic(), status, count, node))
            n += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes


async def throughput_phase(cluster: BenchCluster, clients: int, seconds: float):
    rows = []
    for label, model in (
        ("1 replica, 1 core", "smol-a"),
        ("2 replicas, 2 nodes", "smol-2"),
    ):
        await load(cluster, model, clients, 3, 64)  # warm
        began = time.monotonic()
        outcomes = await load(cluster, model, clients, seconds, 64)
        elapsed = max(end for _, end, *_ in outcomes) - began
        tokens = sum(count for *_, count, _ in outcomes)
        failed = sum(1 for _, _, status, *_ in outcomes if status != 200)
        nodes = Counter(node for *_, node in outcomes if node in ("a", "b"))
        rows.append((label, len(outcomes), failed, tokens / elapsed, dict(nodes)))
    return rows


async def recovery_phase(cluster: BenchCluster) -> dict:
    loop = asyncio.get_running_loop()
    running = asyncio.ensure_future(load(cluster, "smol-2", 4, 30, 16))
    await asyncio.sleep(8)
    killed_at = time.monotonic()
    await loop.run_in_executor(None, cluster.hosts["b"].kill_all)
    unreachable_at = down_at = None
    while time.monotonic() - killed_at < 20:
        status = await loop.run_in_executor(None, cluster.node_status, "b")
        if status in ("unreachable", "down") and unreachable_at is None:
            unreachable_at = time.monotonic() - killed_at
        if status == "down" and down_at is None:
            down_at = time.monotonic() - killed_at
            break
        await asyncio.sleep(0.25)
    outcomes = await running
    failed = [o for o in outcomes if o[2] != 200]
    answered = sorted(end for _, end, status, *_ in outcomes if status == 200)
    gaps = [b - a for a, b in zip(answered, answered[1:], strict=False)]
    after = [end for end in answered if end > killed_at]
    return {
        "requests": len(outcomes),
        "lost": len(failed),
        "lost_examples": [o[4] for o in failed[:3]],
        "longest_gap_s": max(gaps) if gaps else None,
        "served_again_s": (after[0] - killed_at) if after else None,
        "unreachable_s": unreachable_at,
        "down_s": down_at,
        "nodes_after": dict(Counter(o[4] for o in outcomes if o[0] > killed_at)),
    }


def report(ttft, throughput, recovery) -> None:
    print("\nTime to first token, streams through front a (ms, p50; median of rounds)")
    print(f"{'N':>3} {'path':<8} {'TTFT':>8} {'engine':>8} {'path part':>10}")
    for count, path, total, engine, part in ttft:
        print(f"{count:>3} {path:<8} {total:>8.1f} {engine:>8.1f} {part:>10.1f}")
    for count in sorted({row[0] for row in ttft}):
        local = next(r[4] for r in ttft if r[0] == count and r[1] == "local")
        remote = next(r[4] for r in ttft if r[0] == count and r[1] == "remote")
        verdict = "MET" if remote - local <= GOAL_HOP_MS else "NOT MET"
        print(
            f"N={count}: the hop to node b adds {remote - local:+.1f} ms to the path "
            f"(goal <= {GOAL_HOP_MS:g} ms: {verdict})"
        )
    print("\nThroughput, 64-token answers")
    print(f"{'':<22} {'answers':>8} {'failed':>7} {'tok/s':>8}  by node")
    for label, count, failed, rate, nodes in throughput:
        print(f"{label:<22} {count:>8} {failed:>7} {rate:>8.1f}  {nodes}")
    ratio = throughput[1][3] / throughput[0][3]
    verdict = "MET" if ratio >= GOAL_SPEEDUP else "NOT MET"
    print(
        f"2 replicas / 1 replica: {ratio:.2f}x (goal >= {GOAL_SPEEDUP:g}x: {verdict})"
    )
    print("\nRecovery: every process of node b SIGKILLed under load (smol-2)")
    for name, value in recovery.items():
        print(f"  {name}: {value if not isinstance(value, float) else round(value, 2)}")
    served = recovery["served_again_s"]
    verdict = (
        "MET"
        if served is not None and served <= GOAL_RECOVERY_S and not recovery["lost"]
        else "NOT MET"
    )
    print(
        f"served again after {served if served is None else round(served, 2)} s, "
        f"{recovery['lost']} lost (goal <= {GOAL_RECOVERY_S:g} s, none lost: "
        f"{verdict}; LocalAI 74 s, GPUStack 150 s by their documentation)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432")
    args = parser.parse_args()
    why = netns_available()
    if why:
        sys.exit(f"bench/cluster.py cannot run here: {why}")
    with tempfile.TemporaryDirectory(prefix="rh-bench-cluster-") as tmp:
        cluster = BenchCluster(args.postgres, Path(tmp))
        try:
            cluster.start()
            ttft = asyncio.run(ttft_phase(cluster, args.streams, args.rounds))
            throughput = asyncio.run(
                throughput_phase(cluster, args.clients, args.seconds)
            )
            recovery = asyncio.run(recovery_phase(cluster))
        finally:
            cluster.close()
    report(ttft, throughput, recovery)


if __name__ == "__main__":
    main()
