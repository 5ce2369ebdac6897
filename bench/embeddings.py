"""Embedding throughput and memory: one shared engine with micro-batching.

Run: .venv/bin/python bench/embeddings.py [--callers 64 256 1024] [--repeat 3]

Throughput. N concurrent callers each send one short text to one engine (batching
on, the model's default window). Anchors measured in the same run:
  (a) the same N texts sent one at a time to the same engine with batching off
      (max batch size 1, no window): what serving without batching gives;
  (b) one in-process encode() of all N texts: the limit, with no IPC at all.
Goal: >= 3x (a) and >= 0.75x (b).

Memory. 4 client processes embedding through one engine, against 4 processes
that each load the model themselves (the problem a shared engine solves). Goal:
RSS of engine + clients <= (engine + 4 bare clients) x 1.1.
"""

import argparse
import asyncio
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from engines.launch.config import LiveConfig  # noqa: E402
from engines.launch.process import spawn_engine  # noqa: E402
from engines.wire.client import AsyncEngineClient, EngineClient, EngineError  # noqa: E402

# No progress bars from the loaders in the table's way.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

MODEL = "all-minilm-l6-v2"
MODELS_DIR = Path(os.environ.get("ROUNDHOUSE_MODELS_DIR", ROOT / "var" / "models"))
MODEL_PATH = MODELS_DIR / "all-MiniLM-L6-v2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_spec(*, window_ms: float, max_batch: int) -> dict:
    return {
        "name": MODEL,
        "format": "embedding",
        "task": "embedding",
        "path": str(MODEL_PATH),
        "batch_window_ms": window_ms,
        "max_batch_size": max_batch,
    }


class Engine:
    """A real engine process, started as the supervisor starts one."""

    def __init__(self, log_dir: Path) -> None:
        self.port, self.token = free_port(), secrets.token_hex(32)
        config = {
            "name": "bench",
            "port": self.port,
            "models": [model_spec(window_ms=5, max_batch=64)],
            "preload": [MODEL],
            # Enough queue for 1,024 simultaneous single-text callers.
            "limits": {"queue_limit": 64},
        }
        self.process = spawn_engine(
            config=config, token=self.token, log_path=log_dir / "engine.log"
        )
        self.client = EngineClient(port=self.port, token=self.token)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if self.client.ping().phase == "ready":
                    return
            except EngineError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"engine did not start; see {log_dir / 'engine.log'}")

    def configure(self, *, window_ms: float, max_batch: int) -> None:
        spec = model_spec(window_ms=window_ms, max_batch=max_batch)
        self.client.configure(LiveConfig.from_dict({"models": [spec]}))

    def rss(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss

    def stop(self) -> None:
        try:
            self.client.shutdown()
            self.process.wait(30)
        except (EngineError, subprocess.TimeoutExpired):
            self.process.kill()


def texts_for(count: int, round_: int) -> list[str]:
    return [f"caller {i} in round {round_} asks a short question" for i in range(count)]


async def concurrent_callers(engine: Engine, texts: list[str]) -> float:
    client = AsyncEngineClient(port=engine.port, token=engine.token)
    start = time.perf_counter()
    await asyncio.gather(*(client.embed(MODEL, [text]) for text in texts))
    return time.perf_counter() - start


def one_at_a_time(engine: Engine, texts: list[str]) -> float:
    start = time.perf_counter()
    for text in texts:
        engine.client.embed(MODEL, [text])
    return time.perf_counter() - start


def best_of(repeat: int, run) -> float:
    return min(run(round_) for round_ in range(repeat))


def throughput(engine: Engine, callers: list[int], repeat: int) -> None:
    from sentence_transformers import SentenceTransformer

    local = SentenceTransformer(str(MODEL_PATH), device="cpu", local_files_only=True)
    local.encode(texts_for(8, -1))
    asyncio.run(concurrent_callers(engine, texts_for(64, -1)))  # warm up

    rows = []
    for count in callers:
        engine.configure(window_ms=5, max_batch=64)
        batched = best_of(
            repeat,
            lambda r, n=count: asyncio.run(concurrent_callers(engine, texts_for(n, r))),
        )
        engine.configure(window_ms=0, max_batch=1)
        unbatched = best_of(
            repeat, lambda r, n=count: one_at_a_time(engine, texts_for(n, r))
        )
        in_process = best_of(
            repeat,
            lambda r, n=count: _timed(
                lambda: local.encode(texts_for(n, r), batch_size=64)
            ),
        )
        rows.append((count, batched, unbatched, in_process))
    engine.configure(window_ms=5, max_batch=64)

    print("\nThroughput (texts per second, best of", repeat, "runs)")
    print(
        f"{'callers':>8} {'engine batched':>15} {'(a) one at a time':>18} "
        f"{'(b) in-process':>15} {'vs (a)':>8} {'vs (b)':>8}"
    )
    for count, batched, unbatched, in_process in rows:
        print(
            f"{count:>8} {count / batched:>15.0f} {count / unbatched:>18.0f} "
            f"{count / in_process:>15.0f} {unbatched / batched:>7.2f}x "
            f"{in_process / batched:>7.2f}x"
        )
    print("goal: >= 3x (a) and >= 0.75x (b) at 64 callers")


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


CLIENT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {root!r})
    from engines.wire.client import EngineClient
    if {use_engine}:
        client = EngineClient(port={port}, token=os.environ["BENCH_TOKEN"])
        client.embed({model!r}, ["hi"])
    print("ready", flush=True)
    sys.stdin.read()
    """
)
LOADER = textwrap.dedent(
    """
    import sys
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer({path!r}, device="cpu", local_files_only=True)
    model.encode(["hi"])
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def rss_of_processes(code: str, count: int, env: dict) -> list[int]:
    """Start `count` processes running code, wait until each is ready, read RSS."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(count)
    ]
    try:
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise SystemExit("a benchmark client failed to start")
        return [psutil.Process(p.pid).memory_info().rss for p in processes]
    finally:
        for process in processes:
            process.stdin.close()
            process.wait(30)


def memory(engine: Engine) -> None:
    env = {**os.environ, "BENCH_TOKEN": engine.token, "HF_HUB_OFFLINE": "1"}
    fields = {"root": str(ROOT), "port": engine.port, "model": MODEL}
    bare = rss_of_processes(CLIENT.format(use_engine=False, **fields), 4, env)
    clients = rss_of_processes(CLIENT.format(use_engine=True, **fields), 4, env)
    engine_rss = engine.rss()
    loaders = rss_of_processes(LOADER.format(path=str(MODEL_PATH)), 4, env)

    mib = 2**20
    shared = engine_rss + sum(clients)
    budget = (engine_rss + sum(bare)) * 1.1
    print("\nMemory: 4 client processes (RSS, MiB)")
    print(f"{'setup':<42} {'total':>8}")
    print(f"{'engine alone':<42} {engine_rss / mib:>8.0f}")
    print(f"{'4 bare clients (no model, no call)':<42} {sum(bare) / mib:>8.0f}")
    print(f"{'engine + 4 clients embedding through it':<42} {shared / mib:>8.0f}")
    print(f"{'budget: (engine + 4 bare clients) x 1.1':<42} {budget / mib:>8.0f}")
    print(f"{'4 processes each loading the model':<42} {sum(loaders) / mib:>8.0f}")
    print(
        f"shared engine uses {shared / budget:.2f}x its budget (goal <= 1.00x) and "
        f"{sum(loaders) / shared:.1f}x less than 4 separate copies"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if not MODEL_PATH.exists():
        raise SystemExit(f"{MODEL_PATH} missing: run `make test` or `make run` first")
    with tempfile.TemporaryDirectory() as log_dir:
        engine = Engine(Path(log_dir))
        try:
            throughput(engine, args.callers, args.repeat)
            if not args.skip_memory:
                memory(engine)
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
