"""Structured output's cost: N streams whose answers must match a JSON schema,
and N streams with log-probabilities, against the same N streams free.

Run: .venv/bin/python bench/structured.py [--streams 8] [--tokens 128] [--rounds 3]

The platform runs with the settings a fresh `make run` gives (its own temporary
run dir, the bundled SmolLM2 with its automatic slots, `manage.py supervise`,
the front). Each round sends --streams streamed /v1/chat/completions requests
at once, greedy, --tokens tokens each, three times: unconstrained (the
anchor), with `response_format` a JSON schema (an array of at least 40 objects
with an enum, a string and an integer: an answer that cannot end before
--tokens), and unconstrained with `logprobs` and `top_logprobs` 20 (each
token's log-probability and the 20 likeliest beside it, computed over the
whole vocabulary on the decode thread), the order rotating between rounds.
Every stream is asked a question of its own each time (no phase reads
another's prompt from the cache).

Reported: completion tokens per second over each phase, and the p50 time to
first token; medians over the rounds. Ratios: constrained and logprobs
tokens/s over unconstrained (goal >= 0.9 each). The first constrained request
of the run (the model's grammar tokenizer built, the schema compiled) is
timed on its own before the rounds.
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

from bench.front import MODEL, Platform  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "ships": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "kind": {"type": "string", "enum": ["ferry", "trawler", "yacht"]},
                    "crew": {"type": "integer"},
                },
                "required": ["name", "kind", "crew"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["ships"],
    "additionalProperties": False,
}
PHASES = ("unconstrained", "constrained", "logprobs")
TOP_LOGPROBS = 20
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "harbour", "schema": SCHEMA, "strict": True},
}


def question(phase: str, round_: int, index: int) -> str:
    return (
        f"({phase} {round_}.{index}) List every ship in harbour number "
        f"{round_ * 100 + index}, with its name, its kind and its crew, and "
        "tell a long story about each of them."
    )


async def stream(client: openai.AsyncOpenAI, body: dict) -> tuple[float, int]:
    """One streamed answer: (time to first token, completion tokens)."""
    start = time.perf_counter()
    first = None
    tokens = 0
    answer = await client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in answer:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first or 0.0, tokens


async def phase(client, args, name: str, round_: int) -> dict:
    bodies = []
    for index in range(args.streams):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": question(name, round_, index)}],
            "temperature": 0,
            "max_tokens": args.tokens,
        }
        if name == "constrained":
            body["response_format"] = FORMAT
        if name == "logprobs":
            body["logprobs"] = True
            body["top_logprobs"] = TOP_LOGPROBS
        bodies.append(body)
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(client, body) for body in bodies))
    seconds = time.perf_counter() - start
    tokens = sum(count for _, count in results)
    return {
        "tokens_per_s": tokens / seconds,
        "ttft_ms": statistics.median(ttft for ttft, _ in results) * 1000,
        "tokens": tokens,
    }


async def measure(platform: Platform, args) -> dict:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{platform.port}/v1",
        api_key=platform.key,
        max_retries=0,
        timeout=600,
    )
    # Warm both paths' prompt machinery, and time the first grammar alone.
    warm = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Warm up."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    await client.chat.completions.create(**warm)
    start = time.perf_counter()
    first_ttft, _ = await stream(client, {**warm, "response_format": FORMAT})
    cold_ms = (time.perf_counter() - start) * 1000
    again_ttft, _ = await stream(
        client,
        {
            **warm,
            "messages": [{"role": "user", "content": "Again."}],
            "response_format": FORMAT,
        },
    )
    results: dict[str, list[dict]] = {name: [] for name in PHASES}
    for round_ in range(args.rounds):
        shift = round_ % len(PHASES)
        order = [*PHASES[shift:], *PHASES[:shift]]
        for name in order:
            results[name].append(await phase(client, args, name, round_))
    await client.close()
    return {
        "phases": results,
        "first_constrained_ms": cold_ms,
        "first_ttft_ms": first_ttft * 1000,
        "cached_ttft_ms": again_ttft * 1000,
    }


def report(results: dict, args) -> None:
    medians = {
        name: {
            key: statistics.median(run[key] for run in runs)
            for key in ("tokens_per_s", "ttft_ms", "tokens")
        }
        for name, runs in results["phases"].items()
    }
    print(
        f"\n{args.streams} streams x {args.tokens} tokens, greedy, "
        f"median of {args.rounds} rounds (make run defaults)\n"
    )
    print(f"{'phase':<16}{'tokens/s':>10}{'p50 TTFT ms':>14}{'tokens':>9}")
    for name in PHASES:
        row = medians[name]
        print(
            f"{name:<16}{row['tokens_per_s']:>10.1f}{row['ttft_ms']:>14.0f}"
            f"{row['tokens']:>9.0f}"
        )
    print()
    for name in PHASES[1:]:
        ratio = medians[name]["tokens_per_s"] / medians["unconstrained"]["tokens_per_s"]
        print(
            f"{name} / unconstrained tokens/s: {ratio:.2f}x (goal >= 0.9: "
            f"{'MET' if ratio >= 0.9 else 'NOT MET'})"
        )
    print(
        f"first constrained request (grammar tokenizer built, schema compiled): "
        f"TTFT {results['first_ttft_ms']:.0f} ms; the schema again (cached): "
        f"{results['cached_ttft_ms']:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="roundhouse-structured-") as run_dir:
        platform = Platform(Path(run_dir))
        try:
            platform.startup([])
            results = asyncio.run(measure(platform, args))
        finally:
            platform.stop()
    report(results, args)
    print(json.dumps(results["phases"]))


if __name__ == "__main__":
    main()
