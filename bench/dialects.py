"""Each API dialect's time to first token against /v1/chat/completions, in the
same run (issue 35: every dialect is a translation at the edge of one pipeline;
goal: at most +1 ms at the p50).

Run: .venv/bin/python bench/dialects.py [--requests 40] [--tokens 8]

Starts a platform of its own as bench/front.py does (a temporary run dir,
SQLite, the bundled models, `manage.py supervise` and the front as the Procfile
starts it, a fresh API key), then sends the same kind of streamed chat through
each dialect, one request at a time with a pause before each (no other stream
overlaps the one measured), the dialects' order rotating from one request to
the next:
- chat: POST /v1/chat/completions, SSE (the anchor);
- responses: POST /v1/responses, SSE (`response.output_text.delta`);
- messages: POST /v1/messages, SSE (Anthropic's `content_block_delta`);
- ollama: POST /api/chat, NDJSON (the first message with content).
Each request's prompt starts with its own number (so that no request finds
another's prompt in the engine's cache beyond the chat template's start),
greedy, at most `--tokens` tokens. Reported: each dialect's p50 and p90 time to
first token (from sending the request to the first non-empty text), and the
median over rounds of (dialect - chat) in the same round, the figure the goal
is judged on: the prompt's compute varies from one request to the next by more
than a dialect's translation costs, and pairing within a round takes the
machine's drift out.
"""

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.front import MODEL, SEED, Platform, http_open  # noqa: E402
from bench.generation import MODEL_PATH  # noqa: E402

GOAL_MS = 1.0
PAUSE_S = 0.3


def prompt(index: int) -> str:
    return f"{index}. Tell a short story about a lighthouse keeper and a storm."


async def _timed(
    port: int, key: str, path: str, body: dict, first_text: Callable[[dict], str]
) -> float:
    """Seconds from sending the request to the first non-empty text its stream
    carries (SSE `data:` lines or NDJSON lines, whichever the path answers)."""
    start = time.perf_counter()
    reader, writer, status = await http_open(port, "POST", path, key=key, body=body)
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {(await reader.read())[:300]!r}")
    first = None
    while line := await reader.readline():
        line = line.strip()
        if line.startswith(b"data: "):
            line = line[6:]
        if not line.startswith(b"{"):
            continue  # chunk sizes, `event:` lines, [DONE]
        if first is None and first_text(json.loads(line)):
            first = time.perf_counter() - start
    writer.close()
    if first is None:
        raise RuntimeError(f"{path}: no text in the answer")
    return first


def _chat_text(event: dict) -> str:
    choices = event.get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def _responses_text(event: dict) -> str:
    if event.get("type") == "response.output_text.delta":
        return event.get("delta") or ""
    return ""


def _messages_text(event: dict) -> str:
    delta = event.get("delta") or {}
    if event.get("type") == "content_block_delta" and delta.get("type") == "text_delta":
        return delta.get("text") or ""
    return ""


def _ollama_text(event: dict) -> str:
    return (event.get("message") or {}).get("content") or ""


def dialects(tokens: int) -> dict[str, Callable[[int, str, int], Awaitable[float]]]:
    """Each dialect's streamed chat of prompt `index`, timed to its first text."""

    def asked(index: int) -> list[dict]:
        return [{"role": "user", "content": prompt(index)}]

    async def chat(port: int, key: str, index: int) -> float:
        body = {
            "model": MODEL,
            "messages": asked(index),
            "max_tokens": tokens,
            "temperature": 0,
            "seed": SEED,
            "stream": True,
        }
        return await _timed(port, key, "/v1/chat/completions", body, _chat_text)

    async def responses(port: int, key: str, index: int) -> float:
        body = {
            "model": MODEL,
            "input": prompt(index),
            "max_output_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "store": False,
        }
        return await _timed(port, key, "/v1/responses", body, _responses_text)

    async def messages_(port: int, key: str, index: int) -> float:
        body = {
            "model": MODEL,
            "messages": asked(index),
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
        }
        return await _timed(port, key, "/v1/messages", body, _messages_text)

    async def ollama(port: int, key: str, index: int) -> float:
        body = {
            "model": MODEL,
            "messages": asked(index),
            "stream": True,
            "options": {"num_predict": tokens, "temperature": 0, "seed": SEED},
        }
        return await _timed(port, key, "/api/chat", body, _ollama_text)

    return {
        "chat": chat,
        "responses": responses,
        "messages": messages_,
        "ollama": ollama,
    }


async def measure(platform: Platform, requests: int, tokens: int) -> dict:
    ways = dialects(tokens)
    names = list(ways)
    for name in names:  # warm up: the first request loads the model
        await ways[name](platform.port, platform.key, 0)
    results: dict[str, list[float]] = {name: [] for name in names}
    index = 1
    for round_index in range(requests):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            await asyncio.sleep(PAUSE_S)
            results[name].append(await ways[name](platform.port, platform.key, index))
            index += 1
    return results


def report(results: dict[str, list[float]]) -> None:
    anchor = results["chat"]
    print(
        f"\n{'dialect':<10} {'p50 ms':>8} {'p90 ms':>8} {'median of (x - chat) ms':>24}"
    )
    verdicts = []
    for name, seconds in results.items():
        ordered = sorted(seconds)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        paired = statistics.median(x - a for x, a in zip(seconds, anchor, strict=True))
        print(
            f"{name:<10} {statistics.median(seconds) * 1000:>8.1f} "
            f"{p90 * 1000:>8.1f} {paired * 1000:>+24.1f}"
        )
        if name != "chat":
            verdicts.append((name, paired * 1000))
    print()
    for name, added in verdicts:
        verdict = "MET" if added <= GOAL_MS else "NOT MET"
        print(f"{name} vs chat: {added:+.1f} ms (goal <= +{GOAL_MS:g} ms: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="per dialect")
    parser.add_argument("--tokens", type=int, default=8, help="max tokens")
    args = parser.parse_args()
    if not MODEL_PATH.exists():
        raise SystemExit(f"{MODEL_PATH} missing: run `make test` or `make run` first")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="roundhouse-bench-") as tmp:
        platform = Platform(Path(tmp))
        try:
            platform.startup([])
            print(f"platform up in {time.monotonic() - began:.0f} s; measuring")
            results = asyncio.run(measure(platform, args.requests, args.tokens))
        finally:
            platform.stop()
    print(f"done in {time.monotonic() - began:.0f} s")
    report(results)


if __name__ == "__main__":
    main()
