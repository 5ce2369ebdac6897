"""Model files between nodes: how fast a node copies a model it lacks over
the node link (platform/node_link/files.py), against one raw TLS stream of the
same bytes from the same serving process (the anchor: what the link's ranges,
framing and SHA-256 checks cost over the bytes alone).

Run:
    .venv/bin/python bench/model_copy.py [--model PATH] [--rounds 3]

The serving side is a child process (as a node's supervisor is): a relay with
its FileServer on a pinned TLS certificate, and a raw TLS server that writes
the file into one connection in 1 MiB pieces. This process copies the model
into a temporary directory each round, both ways, and reads nothing else:
- link, cold: the first copy, whose manifest makes the server hash the file;
- link: later copies (the server's hash kept), each file hashed again here;
- raw TLS: the anchor, bytes to disk with no check.
Reported: MiB/s (median over the rounds) and the link's ratio to raw TLS.
Goal: the link copies at >= 0.5x of the raw stream.
"""

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

from node_link.client import LinkPool, Peer, client_tls_context  # noqa: E402
from node_link.files import (  # noqa: E402
    FILES_STREAM,
    FileServer,
    copy_model,
    model_digests,
)
from node_link.relay import NodeRelay  # noqa: E402

from cluster.tls import relay_certificate, server_tls_context  # noqa: E402

MODEL = ROOT / "var" / "models" / "gemma-3-270m-q4_k_m.gguf"
SHARED_VARIABLE = "BENCH_LINK_SECRET"
CHUNK = 1 << 20
GOAL = 0.5


async def serve(model: Path, run_dir: Path, relay_port: int, raw_port: int) -> None:
    """The serving node: a relay with the model's files, and the raw anchor."""
    secret = os.environ[SHARED_VARIABLE]

    async def authenticate(node: str, given: str) -> str | None:
        return None if (node, given) == ("a", secret) else "wrong secret"

    async def model_path(name: str) -> Path | None:
        return model if name == "m" else None

    key, cert, _ = relay_certificate(run_dir, "b")
    tls = server_tls_context(key, cert)
    relay = NodeRelay(
        node="b",
        authenticate=authenticate,
        engine_address=lambda name: None,
        files=FileServer(model_path),
    )
    await relay.start("127.0.0.1", relay_port, tls=tls)

    async def raw(reader, writer):
        with open(model, "rb") as handle:
            while chunk := await asyncio.to_thread(handle.read, CHUNK):
                writer.write(chunk)
                await writer.drain()
        writer.close()

    await asyncio.start_server(raw, "127.0.0.1", raw_port, ssl=tls)
    print("serving", flush=True)
    await asyncio.Event().wait()


async def raw_copy(port: int, dest: Path) -> float:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_tls_context()
    )
    with open(dest, "wb") as handle:
        while chunk := await reader.read(CHUNK):
            await asyncio.to_thread(handle.write, chunk)
    writer.close()
    return time.perf_counter() - started


async def link_copy(peer: Peer, secret: str, dest: Path, digests: dict) -> float:
    pool = LinkPool(node="a", secret=secret, plain_tcp=True)

    async def open_stream(data: bytes):
        return (await pool.link(peer)).open(FILES_STREAM, data)

    started = time.perf_counter()
    try:
        await copy_model(
            open_stream, "m", dest, digests=digests, progress=lambda *p: None
        )
    finally:
        pool.close()
    return time.perf_counter() - started


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def measure(model: Path, rounds: int) -> dict[str, list[float]]:
    secret = os.urandom(16).hex()
    relay_port, raw_port = free_port(), free_port()
    times: dict[str, list[float]] = {"link, cold": [], "link": [], "raw TLS": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                str(model),
                str(tmp / "run"),
                str(relay_port),
                str(raw_port),
            ],
            env={**os.environ, SHARED_VARIABLE: secret},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "serving"
            _, _, fingerprint = relay_certificate(tmp / "run", "b")
            peer = Peer("b", "127.0.0.1", relay_port, tls_fingerprint=fingerprint)
            digests = model_digests(model)  # the catalog's
            for round_ in range(rounds + 1):
                dest = tmp / "copies" / f"m-{round_}.gguf"
                kind = "link, cold" if round_ == 0 else "link"
                times[kind].append(await link_copy(peer, secret, dest, digests))
                shutil.rmtree(tmp / "copies")
                if round_:
                    (tmp / "copies").mkdir()
                    times["raw TLS"].append(await raw_copy(raw_port, dest))
                    shutil.rmtree(tmp / "copies")
        finally:
            child.kill()
            child.wait(10)
    return times


def report(model: Path, times: dict[str, list[float]]) -> None:
    mib = model.stat().st_size / 2**20
    print(f"\nCopying {model.name} ({mib:.0f} MiB) over loopback, TLS 1.3")
    print(f"{'path':<12} {'median s':>9} {'MiB/s':>8}")
    rates = {}
    for kind, values in times.items():
        median = statistics.median(values)
        rates[kind] = mib / median
        print(f"{kind:<12} {median:>9.2f} {rates[kind]:>8.0f}")
    ratio = rates["link"] / rates["raw TLS"]
    verdict = "MET" if ratio >= GOAL else "NOT MET"
    print(f"\nlink / raw TLS: {ratio:.2f}x (goal >= {GOAL}x: {verdict})")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        model, run_dir, relay_port, raw_port = sys.argv[2:6]
        asyncio.run(serve(Path(model), Path(run_dir), int(relay_port), int(raw_port)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report(args.model, asyncio.run(measure(args.model, args.rounds)))


if __name__ == "__main__":
    main()
