"""Generation throughput: N concurrent token streams on SmolLM2.

Run: .venv/bin/python bench/generation.py [--streams 1 4 8 16] [--rounds 3]

Each stream asks for 64 tokens (end-of-sequence ignored) on 2 threads. Reported:
aggregate generated tokens per second and the p50 time to first token, medians of
`--rounds` rounds, the servers interleaved within each round. Anchors measured in
the same run:
  - llama.cpp's C++ `llama-server` (continuous batching, -np 16), when
    ROUNDHOUSE_LLAMA_SERVER names its binary (bench/README.md says how to build it);
  - `python -m llama_cpp.server`, the usual Python server (pip extra
    llama-cpp-python[server]; skipped when not installed).
Goal at N=8: >= 0.9x the C++ server and >= 5x llama_cpp.server; N=16 no slower.
"""

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.launch.process import spawn_engine  # noqa: E402
from engines.wire.client import AsyncEngineClient, EngineClient, EngineError  # noqa: E402
from engines.wire.replies import TokenFrame  # noqa: E402
from engines.wire.requests import GenerateRequest  # noqa: E402

MODELS_DIR = Path(os.environ.get("ROUNDHOUSE_MODELS_DIR", ROOT / "var" / "models"))
MODEL_PATH = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS = 64
THREADS = 2
CONTEXT = 512  # per stream
SLOTS = 16
# SmolLM2's special tokens, banned so the anchors also generate all 64 tokens.
EOS_BIAS = {"0": -100.0, "1": -100.0, "2": -100.0}

Stream = Callable[[str], Awaitable[tuple[float, int]]]  # -> (ttft, tokens)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prompt_for(index: int) -> str:
    return f"Story number {index}: once upon a time in a small harbour town,"


# -- HTTP streaming (the anchors), with the standard library only ---------------


async def sse_events(reader: asyncio.StreamReader) -> AsyncIterator[dict]:
    """The JSON events of a Server-Sent Events answer, up to `data: [DONE]`. Each
    event arrives whole in its own chunk, so other lines (chunk sizes) are
    skipped."""
    while line := await reader.readline():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def http_stream(port: int, path: str, body: dict) -> tuple[float, int]:
    """POST a streaming request; returns (time to first token, tokens)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    first, tokens = None, 0
    async for event in sse_events(reader):
        text = event.get("content")
        if text is None:
            choices = event.get("choices") or [{}]
            text = choices[0].get("text")
        if text:
            tokens += 1
            first = first or time.perf_counter() - start
        if event.get("stop") is True:
            break
    writer.close()
    return first or 0.0, tokens


def wait_http(port: int, process: subprocess.Popen, path: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server on {port} exited ({process.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), 1) as sock:
                sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
                if b" 200 " in sock.recv(64):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server on {port} did not come up")


class Server:
    name = ""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.log = open(log_dir / f"{self.name}.log", "wb")  # noqa: SIM115

    async def stream(self, index: int) -> tuple[float, int]:
        raise NotImplementedError

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


class CppServer(Server):
    name = "llama-server (C++)"

    def __init__(self, log_dir: Path, binary: str) -> None:
        super().__init__(log_dir)
        argv = [binary, "-m", str(MODEL_PATH), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "-np", str(SLOTS), "-t", str(THREADS)]
        argv += ["-c", str(CONTEXT * SLOTS), "--no-webui"]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log)
        wait_http(self.port, self.process, "/health")

    async def stream(self, index: int) -> tuple[float, int]:
        body = {
            "prompt": prompt_for(index),
            "n_predict": TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "cache_prompt": False,
        }
        return await http_stream(self.port, "/completion", body)


class PythonServer(Server):
    name = "llama_cpp.server"

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(MODEL_PATH)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--n_threads", str(THREADS), "--n_ctx", str(CONTEXT)]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log)
        wait_http(self.port, self.process, "/v1/models")

    async def stream(self, index: int) -> tuple[float, int]:
        body = {
            "prompt": prompt_for(index),
            "max_tokens": TOKENS,
            "temperature": 0,
            "stream": True,
            "logit_bias": EOS_BIAS,
        }
        return await http_stream(self.port, "/v1/completions", body)


class RoundhouseEngine(Server):
    name = "Roundhouse engine"

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.token = secrets.token_hex(32)
        model = {
            "name": "smollm2",
            "format": "gguf",
            "path": str(MODEL_PATH),
            "context_length": CONTEXT,
            "slots": SLOTS,
        }
        config = {
            "name": "bench",
            "port": self.port,
            "models": [model],
            "preload": ["smollm2"],
            "limits": {
                "threads": THREADS,
                "queue_limit": 256,
                "max_parallel_requests": SLOTS,
            },
        }
        self.process = spawn_engine(
            config=config, token=self.token, log_path=log_dir / "engine.log"
        )
        deadline = time.monotonic() + 120
        client = EngineClient(port=self.port, token=self.token)
        while True:
            try:
                if client.ping().phase == "ready":
                    break
            except EngineError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("engine did not start")
            time.sleep(0.2)
        self.client = AsyncEngineClient(port=self.port, token=self.token)

    async def stream(self, index: int) -> tuple[float, int]:
        start = time.perf_counter()
        first, tokens = None, 0
        request = GenerateRequest(
            model="smollm2",
            prompt=prompt_for(index),
            max_tokens=TOKENS,
            ignore_eos=True,
            temperature=0,
        )
        async for frame in self.client.generate_stream(request):
            if isinstance(frame, TokenFrame):
                tokens += frame.tokens
                first = first or time.perf_counter() - start
        return first or 0.0, tokens


async def one_round(server: Server, streams: int) -> tuple[float, float]:
    """N concurrent streams: (aggregate tokens/s, p50 time to first token)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(server.stream(i) for i in range(streams)))
    elapsed = time.perf_counter() - start
    tokens = sum(count for _, count in results)
    return tokens / elapsed, statistics.median(ttft for ttft, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not MODEL_PATH.exists():
        raise SystemExit(f"{MODEL_PATH} missing: run `make test` or `make run` first")
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        servers: list[Server] = []
        try:
            # Started inside the try: an anchor that fails to start must not
            # leave the servers already running behind.
            servers.append(RoundhouseEngine(log_dir))
            binary = os.environ.get("ROUNDHOUSE_LLAMA_SERVER")
            if binary:
                servers.append(CppServer(log_dir, binary))
            try:
                import llama_cpp.server  # noqa: F401

                servers.append(PythonServer(log_dir))
            except ImportError:
                print("llama_cpp.server not installed: its column is left out")
            for server in servers:  # warm up: first loads, caches, allocations
                asyncio.run(one_round(server, 2))
            results: dict[tuple[str, int], list[tuple[float, float]]] = {}
            for _ in range(args.rounds):
                for streams in args.streams:
                    for server in servers:
                        measured = asyncio.run(one_round(server, streams))
                        results.setdefault((server.name, streams), []).append(measured)
        finally:
            for server in servers:
                server.stop()
    report(servers, args.streams, results)


def report(servers, stream_counts, results) -> None:
    def median(name: str, streams: int) -> tuple[float, float]:
        rows = results[(name, streams)]
        return (
            statistics.median(r[0] for r in rows),
            statistics.median(r[1] for r in rows),
        )

    print(f"\n{TOKENS} tokens per stream, {THREADS} threads; tok/s (p50 TTFT ms)")
    header = f"{'streams':>8}" + "".join(f" {s.name:>24}" for s in servers)
    anchors = [s.name for s in servers[1:]]
    header += "".join(f" {'vs ' + name:>26}" for name in anchors)
    print(header)
    ours = servers[0].name
    for streams in stream_counts:
        line = f"{streams:>8}"
        for server in servers:
            rate, ttft = median(server.name, streams)
            line += f" {rate:>12.0f} ({ttft * 1000:>6.0f} ms)".rjust(25)
        for name in anchors:
            ratio = median(ours, streams)[0] / median(name, streams)[0]
            line += f" {ratio:>25.2f}x"
        print(line)
    print("goal at 8 streams: >= 0.9x llama-server (C++), >= 5x llama_cpp.server")


if __name__ == "__main__":
    main()
