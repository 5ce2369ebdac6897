"""Pulls from the Hub: how fast a model's file comes in through Roundhouse's
pull, against huggingface_hub's own `hf_hub_download` of the same file (the
anchor), and how long it takes from the start of a pull to the model's first
token.

Run:
    .venv/bin/python bench/pull.py [--model PATH] [--rounds 5] [--ttft-rounds 2]

A local hub (tests/hub.py: the Hub's API and its LFS "CDN" on loopback, the
real client against it) serves the bundled SmolLM2 GGUF from a child process,
so every client measured here is the same distance from it. Each round brings
the file into a fresh destination each of these ways, their order rotating:
- hf_hub_download: the anchor, into a fresh cache dir, in this process;
- pull_files: catalog.pull.pull_files alone, on a plan read beforehand (the
  download into the staging folder, the SHA-256 check, the rename), in this
  process;
- manage.py pull: what an operator runs, `manage.py pull hf:ORG/REPO:Q4_1` as a
  child process with HF_ENDPOINT set (Python and Django starting, the plan read
  from the file's header, the download, the check, the catalog row);
- hf_hub_download, own process: the anchor as a script meets it, a fresh
  Python that imports huggingface_hub and calls hf_hub_download (the command
  pays its interpreter's start too: this is the like-for-like anchor for
  `manage.py pull`);
- hf download: huggingface_hub's own command line, the anchor for a command
  (left out when the venv has no `hf`).
Reported: seconds and MiB/s per run (the file's size over the whole call), the
medians, and each path's ratio to hf_hub_download. Goal: >= 0.9x. Where the
time goes: pull_files' download (to its last progress report) and its check
after it, the SHA-256 of the file alone, and the command's stages, timed from
what it prints. Then, pull to first token: the pull, an engine started on the
pulled file (its process ready, then `load`), one streamed chat to its first
token; after `manage.py pull`, and after hf_hub_download as the anchor.
"""

import argparse
import hashlib
import logging
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

MODEL = ROOT / "var" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "bench/SmolLM2-135M-Instruct-GGUF"
GOAL = 0.9
MIB = 1 << 20
ANCHOR = "hf_hub_download"
# The same call in a fresh process of its own, as a script makes it.
PROCESS_ANCHOR = "hf_hub_download, own process"
# The engine's context for the first-token runs (the tests' gguf_spec uses 512).
CONTEXT = 2048


def serve(model: Path) -> None:
    """The hub's process: its address on stdout, then serve until stdin closes."""
    from tests.hub import LocalHub

    with LocalHub({REPO: {model.name: model}}) as hub:
        print(hub.url, flush=True)
        sys.stdin.read()


class Bench:
    """One run's hub, run dir and database, and the ways to bring the file in."""

    def __init__(self, model: Path, tmp: Path, url: str) -> None:
        self.model = model
        self.tmp = tmp
        self.url = url
        self.source = f"hf:{REPO}:{quantization(model.name)}"
        self.runs = 0
        self.hf_cli = Path(sys.executable).parent / "hf"
        self.env = {
            **os.environ,
            "ROUNDHOUSE_RUN_DIR": str(tmp / "run"),
            "DATABASE_URL": f"sqlite:///{tmp / 'run' / 'db.sqlite3'}",
            "HF_ENDPOINT": url,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
        }
        for unset in ("HF_TOKEN", "REDIS_URL"):
            self.env.pop(unset, None)

    def destination(self) -> Path:
        """A fresh, empty folder for one run."""
        self.runs += 1
        path = self.tmp / "runs" / str(self.runs)
        path.mkdir(parents=True)
        return path

    def setup(self) -> None:
        """The database migrated, Django set up in this process, and a pull's
        plan read from the hub (what pull_files is given)."""
        os.environ.update(self.env)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # pull_files draws none
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=self.env,
            check=True,
        )
        import django

        django.setup()
        # The settings log INFO to the console: the client's every request.
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        from catalog.pull import pull_plan

        self.plan = pull_plan(
            self.source, name="bench-plan", endpoint=self.url, token=False
        )

    def hub_download(self, dest: Path) -> tuple[Path, dict]:
        """The anchor: hf_hub_download into a fresh cache dir."""
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(
            REPO, self.model.name, cache_dir=dest, endpoint=self.url, token=False
        )
        return Path(path), {}

    def hub_download_process(self, dest: Path) -> tuple[Path, dict]:
        """The anchor as a script runs it: a fresh Python importing
        huggingface_hub and calling hf_hub_download into a fresh cache dir."""
        script = (
            "import sys\n"
            "from huggingface_hub import hf_hub_download\n"
            "print(hf_hub_download(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3],"
            " endpoint=sys.argv[4], token=False))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, REPO, self.model.name, str(dest), self.url],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        )
        return Path(done.stdout.strip().splitlines()[-1]), {}

    def pull_files(self, dest: Path) -> tuple[Path, dict]:
        """catalog.pull.pull_files alone; its download and check timed apart
        (the download ends at the progress report that reaches the size)."""
        from catalog.pull import pull_files

        started = time.perf_counter()
        downloaded: list[float] = []

        def progress(step) -> None:
            if step.done >= step.size and not downloaded:
                downloaded.append(time.perf_counter())

        path = pull_files(
            self.plan, dest, progress=progress, endpoint=self.url, token=False
        )
        ended = time.perf_counter()
        return path, {
            "download": downloaded[0] - started,
            "check": ended - downloaded[0],
        }

    def startup(self) -> float:
        """Seconds `manage.py pull --help` takes: Python, Django set up and
        the command's imports, no pull."""
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "manage.py", "pull", "--help"],
            cwd=ROOT,
            env=self.env,
            check=True,
            capture_output=True,
        )
        return time.perf_counter() - started

    def command(self, dest: Path) -> tuple[Path, dict]:
        """`manage.py pull` as an operator runs it; its stages timed from what
        it prints (the plan's line, the progress line's end, the row's line)."""
        started = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "manage.py", "pull", self.source]
            + ["--name", f"bench-{self.runs}"],
            cwd=ROOT,
            env={**self.env, "ROUNDHOUSE_MODELS_DIR": str(dest)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        chunks: list[tuple[float, bytes]] = []
        while data := os.read(process.stdout.fileno(), 1 << 16):
            chunks.append((time.perf_counter() - started, data))
        if process.wait() != 0:
            output = b"".join(data for _, data in chunks).decode(errors="replace")
            raise SystemExit(f"manage.py pull failed:\n{output}")
        return self.plan.path(dest), command_stages(chunks)

    def hf_command(self, dest: Path) -> tuple[Path, dict]:
        """The command anchor: `hf download` into a fresh cache dir."""
        subprocess.run(
            [str(self.hf_cli), "download", REPO, self.model.name]
            + ["--cache-dir", str(dest)],
            env=self.env,
            check=True,
            capture_output=True,
        )
        found = list(dest.rglob(self.model.name))
        return found[0], {}

    def paths(self) -> dict[str, Callable[[Path], tuple[Path, dict]]]:
        """Each way to bring the file in, by the name the tables give it."""
        ways = {
            ANCHOR: self.hub_download,
            PROCESS_ANCHOR: self.hub_download_process,
            "pull_files": self.pull_files,
            "manage.py pull": self.command,
        }
        if self.hf_cli.exists():
            ways["hf download"] = self.hf_command
        return ways


def quantization(filename: str) -> str:
    """The quantization a GGUF file's name ends with (`...Q4_1.gguf`: Q4_1)."""
    return filename.removesuffix(".gguf").rsplit(".", 1)[-1]


def command_stages(chunks: list[tuple[float, bytes]]) -> dict:
    """Seconds from the command's start to what it printed: its plan (after
    Python, Django and the header's range requests), the end of its progress
    line (the download and the check), its catalog row; and until it exited."""
    text = b"".join(data for _, data in chunks).decode(errors="replace")
    ends, total = [], 0
    for at, data in chunks:
        total += len(data)
        ends.append((total, at))

    def when(offset: int) -> float:
        return next(at for end, at in ends if end > offset)

    planned = when(text.index("default context"))
    pulled = when(text.index("\n", text.index("\r")))
    added = when(text.index("added model"))
    return {
        "start + plan": planned,
        "download + check": pulled - planned,
        "row": added - pulled,
        "exit": ends[-1][1] - added,
    }


def sha256_seconds(path: Path) -> float:
    """How long the SHA-256 pass over the file takes (its pages cached), as
    catalog.pull._matches reads it."""
    started = time.perf_counter()
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return time.perf_counter() - started


def throughput(bench: Bench, rounds: int) -> dict[str, list[tuple[float, dict]]]:
    """Every path `rounds` times, the order rotating each round; per run its
    seconds and its details, each into a fresh destination removed after."""
    paths = bench.paths()
    names = list(paths)
    results: dict[str, list[tuple[float, dict]]] = {name: [] for name in names}
    size = bench.model.stat().st_size
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            dest = bench.destination()
            started = time.perf_counter()
            path, details = paths[name](dest)
            seconds = time.perf_counter() - started
            if path.stat().st_size != size:
                raise SystemExit(f"{name}: {path} is not the whole file")
            if name == "pull_files":
                details["sha256 alone"] = sha256_seconds(path)
            if name == "manage.py pull":
                details["manage.py pull --help"] = bench.startup()
            results[name].append((seconds, details))
            shutil.rmtree(dest)
    return results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def first_token(bench: Bench, fetch: Callable[[Path], tuple[Path, dict]]) -> dict:
    """Seconds from the start of a pull to the model's first token: the pull,
    an engine process ready, its `load` of the pulled file, and one streamed
    chat to its first token."""
    from engines.launch.process import spawn_engine
    from engines.wire.client import EngineClient, EngineError
    from engines.wire.replies import TokenFrame
    from engines.wire.requests import GenerateRequest

    dest = bench.destination()
    started = time.perf_counter()
    path, _ = fetch(dest)
    pulled = time.perf_counter()
    port, token = free_port(), secrets.token_hex(32)
    model = {
        "name": "pulled",
        "format": "gguf",
        "task": "chat",
        "path": str(path),
        "context_length": CONTEXT,
    }
    config = {"name": "bench", "port": port, "backend": "cpu", "models": [model]}
    process = spawn_engine(config=config, token=token, log_path=dest / "engine.log")
    client = EngineClient(port=port, token=token)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(
                    f"the engine exited:\n{(dest / 'engine.log').read_text()}"
                )
            try:
                if client.ping().phase == "ready":
                    break
            except EngineError:
                pass
            time.sleep(0.02)  # a benchmark's poll, not a test's wait
        ready = time.perf_counter()
        try:
            client.load("pulled", timeout=120)
        except EngineError as error:
            return {"failed": f"{type(error).__name__}: {error}"}
        loaded = time.perf_counter()
        request = GenerateRequest(
            model="pulled",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        stream = client.generate_stream(request)
        for frame in stream:
            if isinstance(frame, TokenFrame):
                break
        token_at = time.perf_counter()
        stream.close()
        again = time.perf_counter()  # the same chat again: what a warm one takes
        stream = client.generate_stream(request)
        for frame in stream:
            if isinstance(frame, TokenFrame):
                break
        again = time.perf_counter() - again
        stream.close()
        client.shutdown()
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(dest)
    return {
        "pull": pulled - started,
        "engine ready": ready - pulled,
        "load": loaded - ready,
        "first token": token_at - loaded,
        "total": token_at - started,
        "2nd chat": again,
    }


def report_throughput(model: Path, results: dict) -> None:
    mib = model.stat().st_size / MIB
    names = list(results)
    rounds = len(results[ANCHOR])
    print(
        f"\nPulling {model.name} ({mib:.1f} MiB) from a local hub on loopback "
        f"(its own process), {rounds} rounds, the order rotating"
    )
    print("MiB/s per run (the file's size over the whole call)")
    print("run  " + "  ".join(f"{name:>{len(name)}}" for name in names))
    for index in range(rounds):
        cells = [f"{mib / results[n][index][0]:>{len(n)}.0f}" for n in names]
        print(f"{index + 1:>3}  " + "  ".join(cells))
    medians = {n: statistics.median(s for s, _ in runs) for n, runs in results.items()}
    bests = {n: min(s for s, _ in runs) for n, runs in results.items()}
    width = max(len(name) for name in names)
    print(
        f"\n{'path':<{width}} {'median s':>9} {'MiB/s':>6} {'x anchor':>9}"
        f" {'best s':>7} {'MiB/s':>6} {'x anchor':>9}"
    )
    for name in names:
        cells = [
            f"{seconds[name]:>{w}.2f} {mib / seconds[name]:>6.0f}"
            f" {seconds[ANCHOR] / seconds[name]:>8.2f}x"
            for seconds, w in ((medians, 9), (bests, 7))
        ]
        print(f"{name:<{width}} " + " ".join(cells))
    print(f"(anchor: {ANCHOR}; best: each path's least disturbed run)")
    print("\nWhere the time goes (s, medians)")
    for name in names:
        details = [d for _, d in results[name] if d]
        if details:
            parts = ", ".join(
                f"{key} {statistics.median(d[key] for d in details):.2f}"
                for key in details[0]
            )
            print(f"  {name}: {parts}")
    fetched = statistics.median(
        d["download + check"] for _, d in results["manage.py pull"]
    )
    print(
        f"  manage.py pull's download + check alone: {mib / fetched:.0f} MiB/s "
        f"({medians[ANCHOR] / fetched:.2f}x {ANCHOR}'s whole call)"
    )
    print()
    for name in ("pull_files", "manage.py pull"):
        ratio = medians[ANCHOR] / medians[name]
        verdict = "MET" if ratio >= GOAL else "NOT MET"
        print(f"{name} / {ANCHOR}: {ratio:.2f}x (goal >= {GOAL}x: {verdict})")
    ratio = medians[PROCESS_ANCHOR] / medians["manage.py pull"]
    verdict = "MET" if ratio >= GOAL else "NOT MET"
    print(
        f"manage.py pull / {PROCESS_ANCHOR} (process to process): {ratio:.2f}x "
        f"(goal >= {GOAL}x: {verdict})"
    )
    if "hf download" in medians:
        ratio = medians["hf download"] / medians["manage.py pull"]
        print(f"manage.py pull / hf download (command to command): {ratio:.2f}x")


def report_first_token(results: dict[str, list[dict]]) -> None:
    rounds = len(next(iter(results.values())))
    print(
        f"\nPull to first token (s; medians of {rounds}; an engine on the pulled "
        f"file, context {CONTEXT}, one chat streamed to its first token; "
        "2nd chat: the same chat's first token again, not in the total)"
    )
    keys = ["pull", "engine ready", "load", "first token", "total", "2nd chat"]
    print(f"{'pulled by':<16} " + " ".join(f"{key:>12}" for key in keys))
    medians = {}
    for name, runs in results.items():
        if failed := [r["failed"] for r in runs if "failed" in r]:
            print(f"{name:<16} {len(failed)} of {len(runs)} failed: {failed[0]}")
            return
        medians[name] = {key: statistics.median(r[key] for r in runs) for key in keys}
        print(f"{name:<16} " + " ".join(f"{medians[name][k]:>12.2f}" for k in keys))
    ratio = medians[ANCHOR]["total"] / medians["manage.py pull"]["total"]
    print(f"manage.py pull to first token / {ANCHOR} to first token: {ratio:.2f}x")


def load_average() -> str:
    """The host's 1, 5 and 15-minute load averages (others' work included)."""
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument(
        "--rounds", type=int, default=5, help="0: the throughput runs left out"
    )
    parser.add_argument(
        "--ttft-rounds", type=int, default=2, help="0: pull to first token left out"
    )
    args = parser.parse_args()
    if not args.model.is_file():
        raise SystemExit(f"{args.model}: no such file (make test sets up the models)")
    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp:
        hub = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(args.model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            bench = Bench(args.model, Path(tmp), hub.stdout.readline().strip())
            bench.setup()
            print(f"load average at the start: {load_average()}")
            if args.rounds:
                report_throughput(args.model, throughput(bench, args.rounds))
            if args.ttft_rounds:
                ways = {ANCHOR: bench.hub_download, "manage.py pull": bench.command}
                ttft: dict[str, list[dict]] = {name: [] for name in ways}
                for round_ in range(args.ttft_rounds):
                    order = list(ways)[round_ % 2 :] + list(ways)[: round_ % 2]
                    for name in order:
                        ttft[name].append(first_token(bench, ways[name]))
                report_first_token(ttft)
            print(f"load average at the end: {load_average()}")
        finally:
            hub.stdin.close()
            try:
                hub.wait(10)
            except subprocess.TimeoutExpired:
                hub.kill()
                hub.wait()


if __name__ == "__main__":
    main()
