"""Front overhead: /v1/chat/completions (SSE) and the WebSocket chat versus the
engine client directly.

Run: .venv/bin/python bench/front.py [--concurrency 1 8] [--rounds 5] [--tokens 16]

Starts a platform of its own in a temporary run dir (SQLite, the bundled models,
the seed migration's engine cpu0, a fresh API key): `manage.py supervise` and the
front (roundhouse.serve, as the Procfile starts it) on loopback. Each stream asks
`smollm2-135m-instruct` for a chat answer of at most `--tokens` tokens, greedy
(temperature 0, fixed seed, end-of-sequence honoured), the same prompts on both
paths, so both do the same work (the bench counts the texts that match; in a
batch of 8 a few can differ by a near-tie).

Reported, medians of `--rounds` rounds, the paths interleaved within each round:
the p50 over N concurrent streams of the time until the engine admitted the
request (the response's headers; the `start` message; the start frame), to the
first token (the first non-empty content) and to the end, through the front's
REST API (sse), through its WebSocket chat (ws: N sockets opened and
authenticated beforehand, as a browser's chat page keeps its socket open; each
stream is timed from its `chat` message) and through `AsyncEngineClient` (the
anchor, direct); sse-direct and ws-direct are the medians of the rounds'
differences. Time to first token is split in two: the engine's own part (its
`timings.first_token_ms`, from the request's arrival in the engine: the prompt's
compute) and the path's part (the rest: connections, the front, the relay of the
token). The prompt's compute on 2 busy cores varies by tens of ms from one
request to the next, far more than the front's cost, so the goal is judged on the
path's part, where that variation is taken out; the engine's own part shows
whether the front's work slowed the engine down.

Each path's round starts after a pause of 0.5 s, so that the previous path's
after-work (usage rows, the WebSocket chat's stored turns) is not charged to it.
The "1 idle" rows: single streams, alternating paths, each after an idle pause,
so that no other stream's decoding or clean-up (in the engine or in the front)
overlaps the one measured. Then the p50 round trips of GET /healthz (the server
and Django's request handling, the cached routing snapshot) and GET /v1/models
(the same plus the key check), with nothing generating.
Goal: the front adds <= 3 ms to p50 time to first token, on either path.
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import connect as ws_connect  # noqa: E402

from bench.generation import (  # noqa: E402
    MODEL_PATH,
    MODELS_DIR,
    free_port,
    sse_events,
)
from engines.wire.client import AsyncEngineClient, connect_and_send  # noqa: E402
from engines.wire.replies import DoneFrame, StartFrame, TokenFrame  # noqa: E402
from engines.wire.requests import GenerateRequest  # noqa: E402

MODEL = "smollm2-135m-instruct"  # its name in the seed migration
ENGINE = "cpu0"
SEED = 1234
GOAL_MS = 3.0
PROBES = 40  # sequential round trips per probe of the front alone
ISOLATED = 30  # single streams per path, each after an idle pause
ISOLATED_PAUSE_S = 0.5
# The paths measured: REST with SSE, the WebSocket chat, the engine client.
PATHS = ("sse", "ws", "direct")


@dataclass
class Stream:
    """One stream's times from its request, in seconds, and its text."""

    start: float  # the engine admitted it: the headers, or the start frame
    ttft: float  # the first non-empty content
    total: float  # the end of the stream
    text: str
    engine_ttft: float  # the engine's own time from the request's arrival to it

    @property
    def path(self) -> float:
        """Time to first token less the engine's own: what the path to the engine
        and back adds (connections, the front), without the prompt's compute."""
        return self.ttft - self.engine_ttft


def messages_for(index: int) -> list[dict]:
    prompt = f"Tell story number {index} about a lighthouse keeper and a storm."
    return [{"role": "user", "content": prompt}]


# -- HTTP, with the standard library only -----------------------------------------


async def http_open(
    port: int, method: str, path: str, *, key: str = "", body: dict | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """Send one request (a new connection, as a client without keep-alive would);
    returns the reader past the headers, the writer and the status. It is sent
    as the engine client sends its requests (`connect_and_send`), so that
    neither path's client is the slower one at a burst of requests."""
    payload = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    reader, writer = await connect_and_send(port, head.encode() + payload, timeout=10)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    return reader, writer, status


async def http_roundtrip(port: int, path: str, key: str = "") -> float:
    """GET a path and read the whole answer; returns seconds."""
    start = time.perf_counter()
    reader, writer, status = await http_open(port, "GET", path, key=key)
    body = await reader.read()
    elapsed = time.perf_counter() - start
    writer.close()
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}: {body[:300]!r}")
    return elapsed


async def front_stream(port: int, key: str, index: int, tokens: int) -> Stream:
    """A streamed chat completion through the front."""
    body = {
        "model": MODEL,
        "messages": messages_for(index),
        "max_tokens": tokens,
        "temperature": 0,
        "seed": SEED,
        "stream": True,
    }
    start = time.perf_counter()
    reader, writer, status = await http_open(
        port, "POST", "/v1/chat/completions", key=key, body=body
    )
    if status != 200:
        raise RuntimeError(f"front: HTTP {status}: {(await reader.read())[:300]!r}")
    # The front answers 200 once the engine has admitted the request.
    admitted, first, parts, engine_ttft = time.perf_counter() - start, None, [], 0.0
    async for event in sse_events(reader):
        if "error" in event:
            raise RuntimeError(f"front: {event['error']}")
        if "timings" in event:
            engine_ttft = event["timings"]["engine_first_token_ms"] / 1000
        if not event["choices"]:
            continue
        text = event["choices"][0]["delta"].get("content")
        if text:
            first = first or time.perf_counter() - start
            parts.append(text)
    total = time.perf_counter() - start
    writer.close()
    return Stream(admitted, first or total, total, "".join(parts), engine_ttft)


async def ws_open(port: int, key: str):
    """A chat socket, authenticated with the key, ready for streams."""
    socket = await ws_connect(f"ws://127.0.0.1:{port}/ws/chat/", max_size=None)
    await socket.send(json.dumps({"type": "auth", "key": key}))
    ready = json.loads(await socket.recv())
    if ready.get("type") != "ready":
        raise RuntimeError(f"ws: not ready: {ready}")
    return socket


async def ws_stream(socket, index: int, tokens: int) -> Stream:
    """The same chat completion through the WebSocket chat, on an open socket."""
    chat = {
        "type": "chat",
        "id": str(index),
        "model": MODEL,
        "messages": messages_for(index),
        "params": {"max_tokens": tokens, "temperature": 0, "seed": SEED},
    }
    start = time.perf_counter()
    await socket.send(json.dumps(chat, separators=(",", ":")))
    admitted, first, parts, engine_ttft = None, None, [], 0.0
    while True:
        message = json.loads(await socket.recv())
        kind = message["type"]
        if kind == "start":
            admitted = time.perf_counter() - start
        elif kind == "token" and message["text"]:
            first = first or time.perf_counter() - start
            parts.append(message["text"])
        elif kind == "done":
            engine_ttft = (message["timings"]["engine_first_token_ms"] or 0) / 1000
            break
        elif kind == "error":
            raise RuntimeError(f"ws: {message}")
    total = time.perf_counter() - start
    return Stream(admitted or total, first or total, total, "".join(parts), engine_ttft)


async def direct_stream(client: AsyncEngineClient, index: int, tokens: int) -> Stream:
    """The same chat completion through the engine client (the anchor)."""
    start = time.perf_counter()
    admitted, first, parts, engine_ttft = None, None, [], 0.0
    request = GenerateRequest(
        model=MODEL,
        messages=messages_for(index),
        max_tokens=tokens,
        temperature=0,
        seed=SEED,
    )
    async for frame in client.generate_stream(request):
        if isinstance(frame, StartFrame):
            admitted = time.perf_counter() - start
        if isinstance(frame, TokenFrame) and frame.text:
            first = first or time.perf_counter() - start
            parts.append(frame.text)
        if isinstance(frame, DoneFrame):
            engine_ttft = (frame.timings.first_token_ms or 0.0) / 1000
    total = time.perf_counter() - start
    return Stream(admitted or total, first or total, total, "".join(parts), engine_ttft)


# -- the platform under test ------------------------------------------------------


class Platform:
    """A supervisor and a front on an isolated run dir: startup / stop."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.port = free_port()
        self.env = {
            **os.environ,
            "ROUNDHOUSE_RUN_DIR": str(run_dir),
            "DATABASE_URL": f"sqlite:///{run_dir / 'db.sqlite3'}",
            "ROUNDHOUSE_MODELS_DIR": str(MODELS_DIR),
            "PYTHONPATH": os.pathsep.join(["platform", "."]),
            "DJANGO_SETTINGS_MODULE": "roundhouse.settings",
        }
        # Embedded defaults only: no shared Redis, no debug query log.
        for name in ("REDIS_URL", "DEBUG"):
            self.env.pop(name, None)
        self.processes: list[subprocess.Popen] = []
        self.log = open(run_dir / "platform.log", "wb")  # noqa: SIM115

    def manage(self, *argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *argv],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"manage.py {argv[0]} failed:\n{done.stderr}")
        return done.stdout

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        # A session of its own: Ctrl-C reaches the bench, which stops it in order.
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def startup(self, engine_cpus: list[int]) -> None:
        self.manage("migrate", "--noinput")
        # Engines listen on base port + order: a free one, not the developer's.
        # With --engine-cpus the engine runs on those cores (its spec's CPU
        # cores), and everything else (supervisor, front, this bench) on the rest.
        self.manage(
            "shell",
            "-c",
            "from fleet.models import EngineSpec, ServerSettings\n"
            "row = ServerSettings.load()\n"
            f"row.base_port = {free_port()}\n"
            "row.full_clean()\n"
            "row.save()\n"
            f"EngineSpec.objects.filter(name={ENGINE!r})"
            f".update(cpus={','.join(map(str, engine_cpus))!r})",
        )
        if engine_cpus:
            os.sched_setaffinity(0, os.sched_getaffinity(0) - set(engine_cpus))
        output = self.manage("create_api_key", "bench")
        self.key = next(
            line.strip() for line in output.splitlines() if line.startswith("rh-")
        )
        self.spawn([sys.executable, "manage.py", "supervise"])
        # The front as `make run` starts it (Procfile), less its access log.
        front = [sys.executable, "-m", "roundhouse.serve", "--port", str(self.port)]
        self.spawn([*front, "--no-access-log"])
        self.wait_ready()
        self.client = AsyncEngineClient.for_engine(self.run_dir, ENGINE)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise SystemExit(
                        f"{process.args[:3]} exited ({process.returncode}); "
                        f"see {self.log.name}"
                    )
            try:
                with socket.create_connection(("127.0.0.1", self.port), 1) as sock:
                    sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                    answer = b""
                    while chunk := sock.recv(4096):
                        answer += chunk
                connection_file = self.run_dir / "engines" / f"{ENGINE}.json"
                if b'"engines_ready": true' in answer and connection_file.exists():
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the platform did not come up; see {self.log.name}")

    def stop(self) -> None:
        """The front first, then the supervisor, which drains its engines."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.log.close()


# -- measuring --------------------------------------------------------------------


async def one_round(
    platform: Platform, path: str, streams: int, tokens: int
) -> list[Stream]:
    """N concurrent streams through one path."""
    if path == "sse":
        runs = (
            front_stream(platform.port, platform.key, i, tokens) for i in range(streams)
        )
    elif path == "ws":
        runs = (ws_stream(platform.sockets[i], i, tokens) for i in range(streams))
    else:
        runs = (direct_stream(platform.client, i, tokens) for i in range(streams))
    return await asyncio.gather(*runs)


async def measure(platform: Platform, args) -> tuple[dict, dict]:
    platform.sockets = [
        await ws_open(platform.port, platform.key)
        for _ in range(max(2, *args.concurrency))
    ]
    for path in PATHS:  # warm up: the first request loads the model
        await one_round(platform, path, 2, args.tokens)
    results: dict[tuple[str, int], list[list[Stream]]] = {}
    for round_index in range(args.rounds):
        for streams in args.concurrency:
            # Rotate which path goes first, so none always follows another.
            shift = round_index % len(PATHS)
            paths = PATHS[shift:] + PATHS[:shift]
            for path in paths:
                # Each path starts with the front quiet: the previous path's
                # after-work (usage rows, the WebSocket chat's stored turns)
                # is not charged to it.
                await asyncio.sleep(ISOLATED_PAUSE_S)
                measured = await one_round(platform, path, streams, args.tokens)
                results.setdefault((path, streams), []).append(measured)
    # Single requests with the machine idle in between: no other stream's
    # decode or clean-up (in the engine or the front) overlaps the one measured.
    for index in range(ISOLATED):
        shift = index % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            await asyncio.sleep(ISOLATED_PAUSE_S)
            measured = await one_round(platform, path, 1, args.tokens)
            results.setdefault((path, "isolated"), []).append(measured)
    probes: dict[str, list[float]] = {}
    for _ in range(PROBES):
        for path, key in (("/healthz", ""), ("/v1/models", platform.key)):
            probe = await http_roundtrip(platform.port, path, key)
            probes.setdefault(path, []).append(probe)
    for chat_socket in platform.sockets:
        await chat_socket.close()
    return results, probes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens")
    parser.add_argument(
        "--engine-cpus",
        type=int,
        nargs="+",
        default=[],
        metavar="CORE",
        help="run the engine on these cores and the rest (front, bench) on the "
        "others; default: all share every core",
    )
    args = parser.parse_args()
    if args.engine_cpus and not set(args.engine_cpus) < os.sched_getaffinity(0):
        raise SystemExit(
            f"--engine-cpus must leave a core of {sorted(os.sched_getaffinity(0))}"
        )
    if not MODEL_PATH.exists():
        raise SystemExit(f"{MODEL_PATH} missing: run `make test` or `make run` first")
    # SIGTERM stops the bench like Ctrl-C: the platform is still torn down.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="roundhouse-bench-") as tmp:
        platform = Platform(Path(tmp))
        try:
            platform.startup(args.engine_cpus)
            print(f"platform up in {time.monotonic() - began:.0f} s; measuring")
            results, probes = asyncio.run(measure(platform, args))
        finally:
            platform.stop()
    print(f"done in {time.monotonic() - began:.0f} s")
    report(args, results, probes)


def report(args, results, probes) -> None:
    def p50(path: str, streams: int, field: str) -> list[float]:
        """Each round's median stream, in ms."""
        rounds = results[(path, streams)]
        return [statistics.median(getattr(s, field) for s in r) * 1000 for r in rounds]

    placement = (
        f"engine on cores {args.engine_cpus}, the rest on the others"
        if args.engine_cpus
        else f"all processes share the {len(os.sched_getaffinity(0))} cores"
    )
    print(
        f"\n{MODEL}, at most {args.tokens} tokens per stream, greedy; "
        f"p50 ms, medians of {args.rounds} rounds; {placement}"
    )
    print(
        f"{'streams':>7}  {'':<22}{'sse':>8}{'ws':>8}{'direct':>8}"
        f"{'sse-direct':>12}{'ws-direct':>11}"
    )
    rows = (
        ("start", "engine admitted"),
        ("ttft", "time to first token"),
        ("engine_ttft", "  engine's own part"),
        ("path", "  path's part"),
        ("total", "total"),
    )
    added: dict[str, dict] = {"sse": {}, "ws": {}}
    for streams in [*args.concurrency, "isolated"]:
        shown = "1 idle" if streams == "isolated" else streams
        for field, label in rows:
            directs = p50("direct", streams, field)
            line = f"{shown:>7}  {label:<22}"
            differences = ""
            for path in ("sse", "ws"):
                measured = p50(path, streams, field)
                # Paired by round: load that drifts across rounds cancels out.
                pairs = zip(measured, directs, strict=True)
                difference = statistics.median(m - d for m, d in pairs)
                line += f"{statistics.median(measured):>8.1f}"
                width = 12 if path == "sse" else 11
                differences += f"{difference:>+{width}.1f}"
                if field == "path":
                    added[path][shown] = difference
            print(line + f"{statistics.median(directs):>8.1f}" + differences)
    same = []
    for streams in args.concurrency:
        for path in ("sse", "ws"):
            pairs = zip(
                results[(path, streams)], results[("direct", streams)], strict=True
            )
            equal = sum(
                one.text == direct.text
                for one_round_, direct_round in pairs
                for one, direct in zip(one_round_, direct_round, strict=True)
            )
            same.append(f"{path} N={streams}: {equal} of {args.rounds * streams}")
    print(f"same text as direct: {', '.join(same)} streams")
    for path, times in probes.items():
        print(
            f"front alone, GET {path}: p50 {statistics.median(times) * 1000:.1f} ms"
            f" ({len(times)} sequential round trips, nothing generating)"
        )
    for path, by_streams in added.items():
        verdict = "met" if max(by_streams.values()) <= GOAL_MS else "NOT met"
        print(
            f"goal ({path}): the front adds <= {GOAL_MS:g} ms to p50 time to first "
            f"token (the path's part, {path}-direct): {verdict} ("
            + ", ".join(f"N={n}: {ms:+.1f} ms" for n, ms in by_streams.items())
            + ")"
        )


if __name__ == "__main__":
    main()
