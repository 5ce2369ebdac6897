"""Batch jobs against live traffic: what a Batch API job costs the people
chatting at the same time, and what it gets done.

Run: .venv/bin/python bench/batch.py [--lines 1000] [--concurrency 16]

The platform runs with the settings a fresh `make run` gives (its own temporary
run dir, the bundled SmolLM2 with its automatic slots, `manage.py supervise`,
the front, a Celery worker on the filesystem broker). Every request is a short
chat question answered in at most --tokens tokens, greedy, each phase with its
own questions (no phase reads another's prompts from the cache).

Phases, one after the other:
1. live (the anchor): --lines requests sent to /v1/chat/completions by
   --concurrency callers at once; completion tokens/s over the phase.
2. batch: the same number of lines as one Batch API job (upload, create, poll
   until completed); completion tokens/s from its creation to its completion.
   The worker keeps ROUNDHOUSE_BATCH_CONCURRENCY lines in flight (default 16,
   the same as --concurrency by default).
3. time to first token of live streamed requests (--probes callers, each asking,
   reading the whole answer, pausing 0.3 s, again) for --probe-s seconds with
   nothing else running, then for as long while a second batch runs.

Ratios: batch tokens/s over live (goal >= 0.9); live p50 TTFT while a batch
runs over with none (goal <= 1.2).
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
import psutil  # noqa: E402

from bench.front import MODEL, Platform  # noqa: E402

SUBJECTS = [
    "a harbour",
    "a lighthouse",
    "a ferry",
    "an island",
    "a storm",
    "a gull",
    "a fisherman",
    "a map",
    "a tide",
    "a rope",
    "a sail",
    "a crab",
]


def question(phase: str, index: int) -> str:
    subject = SUBJECTS[index % len(SUBJECTS)]
    return f"{phase} #{index}: in one sentence, describe {subject}."


def body(phase: str, index: int, tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question(phase, index)}],
        "max_tokens": tokens,
        "temperature": 0,
    }


async def live_phase(client: openai.AsyncOpenAI, args) -> tuple[float, int]:
    """--lines requests by --concurrency callers; (seconds, completion tokens)."""
    pending = list(range(args.lines))
    tokens = 0

    async def caller():
        nonlocal tokens
        while pending:
            index = pending.pop()
            answer = await client.chat.completions.create(
                **body("live", index, args.tokens)
            )
            tokens += answer.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(args.concurrency)))
    return time.perf_counter() - start, tokens


async def start_batch(client: openai.AsyncOpenAI, phase: str, args) -> str:
    lines = [
        {
            "custom_id": f"{phase}-{index}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body(phase, index, args.tokens),
        }
        for index in range(args.lines)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = await client.files.create(file=("bench.jsonl", data), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    return batch.id


async def wait_batch(client: openai.AsyncOpenAI, batch_id: str):
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.25)


async def batch_tokens(client: openai.AsyncOpenAI, batch) -> int:
    content = await client.files.content(batch.output_file_id)
    return sum(
        json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
        for line in content.text.splitlines()
    )


async def batch_phase(client: openai.AsyncOpenAI, args) -> tuple[float, int, object]:
    start = time.perf_counter()
    batch = await wait_batch(client, await start_batch(client, "batch", args))
    elapsed = time.perf_counter() - start
    if batch.request_counts.failed:
        print(f"warning: {batch.request_counts.failed} lines failed", flush=True)
    return elapsed, await batch_tokens(client, batch), batch


async def probe(
    client: openai.AsyncOpenAI, phase: str, until: float
) -> list[tuple[float, float | None]]:
    """TTFTs of one live caller asking again and again until `until`: as the
    caller sees it, and the engine's own (from the request's arrival there)."""
    firsts, index = [], 0
    while time.perf_counter() < until:
        index += 1
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            **body(phase, index, 8), stream=True
        )
        first = engine = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            timings = (chunk.model_extra or {}).get("timings")
            if timings:
                engine = timings.get("engine_first_token_ms")
        if first is not None:
            firsts.append((first, engine))
        await asyncio.sleep(0.3)
    return firsts


async def ttft_phase(client, args, phase: str) -> list[float]:
    until = time.perf_counter() + args.probe_s
    runs = await asyncio.gather(
        *(probe(client, f"{phase}{n}", until) for n in range(args.probes))
    )
    return [value for run in runs for value in run]


def cpu_seconds(platform: Platform) -> dict[str, float]:
    """CPU seconds used so far by each kind of process of the platform (its
    engines are the supervisor's children)."""
    used: dict[str, float] = {}
    for process in platform.processes:
        try:
            top = psutil.Process(process.pid)
            family = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in family:
            try:
                line = " ".join(member.cmdline())
                times = member.cpu_times()
            except psutil.NoSuchProcess:
                continue
            kind = (
                "engine"
                if "engines.runtime.serve" in line
                else "worker"
                if "celery" in line
                else "front"
                if "roundhouse.serve" in line
                else "supervisor"
            )
            used[kind] = used.get(kind, 0.0) + times.user + times.system
    return used


def cpu_share(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores used on average by each kind of process over a phase."""
    return {k: (after[k] - before.get(k, 0.0)) / seconds for k in sorted(after)}


async def measure(platform: Platform, args) -> dict:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{platform.port}/v1",
        api_key=platform.key,
        max_retries=0,
        timeout=600,
    )
    # Warm up: the first request loads the model.
    await client.chat.completions.create(**body("warm", 0, 4))
    cpu = {}
    print("live phase", flush=True)
    before = cpu_seconds(platform)
    live_s, live_tokens = await live_phase(client, args)
    cpu["live"] = cpu_share(before, cpu_seconds(platform), live_s)
    print("batch phase", flush=True)
    before = cpu_seconds(platform)
    batch_s, tokens, batch = await batch_phase(client, args)
    cpu["batch"] = cpu_share(before, cpu_seconds(platform), batch_s)
    print("time to first token, idle", flush=True)
    before = cpu_seconds(platform)
    idle = await ttft_phase(client, args, "idle")
    cpu["probes, no batch"] = cpu_share(before, cpu_seconds(platform), args.probe_s)
    print("time to first token, during a batch", flush=True)
    running = await start_batch(client, "during", args)
    while (await client.batches.retrieve(running)).status == "validating":
        await asyncio.sleep(0.1)
    before = cpu_seconds(platform)
    during = await ttft_phase(client, args, "busy")
    cpu["probes, batch"] = cpu_share(before, cpu_seconds(platform), args.probe_s)
    still = (await client.batches.retrieve(running)).status == "in_progress"
    await client.batches.cancel(running)
    return {
        "cpu": cpu,
        "live": (live_s, live_tokens),
        "batch": (batch_s, tokens),
        "batch_counts": batch.request_counts,
        "idle": idle,
        "during": during,
        "batch_ran_throughout": still,
    }


def report(results: dict, args) -> None:
    live_s, live_tokens = results["live"]
    batch_s, batch_tokens_ = results["batch"]
    live_rate, batch_rate = live_tokens / live_s, batch_tokens_ / batch_s
    idle, during = results["idle"], results["during"]
    print()
    print(
        f"{args.lines} lines, {args.tokens} tokens each at most, greedy; "
        f"{args.concurrency} at once"
    )
    print(f"{'phase':<26}{'seconds':>9}{'tokens':>9}{'tok/s':>9}")
    print(f"{'live (anchor)':<26}{live_s:>9.1f}{live_tokens:>9}{live_rate:>9.1f}")
    print(f"{'batch':<26}{batch_s:>9.1f}{batch_tokens_:>9}{batch_rate:>9.1f}")
    print()
    print(f"{'live TTFT':<26}{'n':>5}{'p50 ms':>9}{'p90 ms':>9}{'engine p50':>12}")
    for name, probes in (("no batch", idle), ("during a batch", during)):
        ordered = sorted(first for first, _ in probes)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        engine = [ms for _, ms in probes if ms is not None]
        engine_p50 = f"{statistics.median(engine):>12.0f}" if engine else f"{'-':>12}"
        print(
            f"{name:<26}{len(ordered):>5}{statistics.median(ordered) * 1000:>9.0f}"
            f"{p90 * 1000:>9.0f}{engine_p50}"
        )
    print()
    kinds = sorted({kind for shares in results["cpu"].values() for kind in shares})
    print(f"{'cores used':<26}" + "".join(f"{kind:>11}" for kind in kinds))
    for phase, shares in results["cpu"].items():
        print(f"{phase:<26}" + "".join(f"{shares.get(k, 0):>11.2f}" for k in kinds))
    print()
    ratio = batch_rate / live_rate
    print(
        f"batch tokens/s over live: {ratio:.2f} (goal >= 0.9, "
        f"{'MET' if ratio >= 0.9 else 'NOT MET'})"
    )
    rise = statistics.median(f for f, _ in during) / statistics.median(
        f for f, _ in idle
    )
    print(
        f"live p50 TTFT during a batch over none: {rise:.2f} (goal <= 1.2, "
        f"{'MET' if rise <= 1.2 else 'NOT MET'})"
    )
    if not results["batch_ran_throughout"]:
        print(
            "warning: the second batch ended before the probes did: "
            "raise --lines or lower --probe-s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--probes", type=int, default=2)
    parser.add_argument("--probe-s", type=float, default=40.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="roundhouse-batch-") as run_dir:
        platform = Platform(Path(run_dir))
        try:
            platform.startup([])
            platform.spawn(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "roundhouse",
                    "worker",
                    "--pool",
                    "threads",
                    "--concurrency",
                    "4",
                    "--loglevel",
                    "INFO",
                ]
            )
            results = asyncio.run(measure(platform, args))
        finally:
            platform.stop()
    report(results, args)


if __name__ == "__main__":
    main()
