"""Chat as people use it: many conversations at once, each turn resending the
whole conversation after a shared system prompt, and the same conversations
again in a second pass.

Run: .venv/bin/python bench/chat.py [--users 32] [--turns 4] [--passes 2]
     [--only NAME ...]

Each simulated user opens a conversation with the same ~400-token system prompt,
asks a short question, waits for the whole streamed answer (SSE, at most
`--answer-tokens` tokens, 48 by default, greedy), thinks for a moment
(0.5-1.5 s, seeded) and asks the next question with the conversation so far,
`--turns` times. Users start within the first second, in a seeded order. A
second pass sends the same conversations again (greedy: the same answers), the
servers' caches warm, as people come back to a chat.

Servers, one after the other, each on the same conversations:
- `llama-server-tuned` (the anchor): llama.cpp's C++ server on the same GGUF
  file and thread count, tuned to Roundhouse's default shape for the model
  (`-np 32 -c 65536`: its slots and its KV pool), through its
  /v1/chat/completions. Built as bench/README.md says and found through
  ROUNDHOUSE_LLAMA_SERVER; left out without it;
- `llama-server`: the same with its own defaults (4 slots; `--only` it);
- `roundhouse`: the platform with the settings a fresh `make run` gives (its own
  temporary run dir, the bundled models, `manage.py supervise`, the front), through
  /v1/chat/completions with an API key;
- `roundhouse-groups`: the same with the KV budget of before 2026-12-08 (1,024
  MiB: 46,603 tokens, under 32 whole contexts), which splits the slots into 4
  KV groups instead of a KV stream per slot (the default since);
- `roundhouse-nocache`: the same with the model's prompt cache switched off in
  the admin (ModelConfig.prompt_cache), the control for the cache's effect.
By default the anchor and `roundhouse` run.

Reported per server and pass: aggregate completion tokens/s over the pass,
p50 and p99 time to first token per turn (and the engine's own part of it),
prompt tokens sent and the share the server took from its cache. Ratios, per
pass: Roundhouse's tokens/s over the anchor's (goals: >= 1.2 on the first
pass, >= 1.0 on the second) and each turn's p50 TTFT over the anchor's (goal
<= 1.0 each); with `roundhouse-nocache`, the last turn's p50 TTFT with the
cache over without (goal <= 0.25).
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.front import MODEL, Platform, http_open  # noqa: E402
from bench.generation import MODEL_PATH, THREADS, free_port, wait_http  # noqa: E402

SEED = 20261201
LLAMA_SERVERS = ("llama-server", "llama-server-tuned")
TIMEOUT_S = 600.0  # one answer, queueing included

SYSTEM_PROMPT = " ".join(
    [
        "You are Harbourline's support assistant. Harbourline runs passenger",
        "ferries between six island ports and the mainland, all year round, with",
        "more sailings in summer. Answer in plain, friendly English, in at most",
        "three short sentences, and never invent timetables or prices: when you",
        "do not know, say so and point to the ticket office. Tickets can be",
        "bought online, at the ports' ticket offices or on board (cash or card,",
        "with a surcharge of two euros on board). Children under four travel",
        "free; children from four to eleven pay half fare; students and people",
        "over sixty-five get a quarter off with a card that shows it. Bicycles",
        "travel free on every route; cars, vans and motorbikes must be booked at",
        "least a day ahead in summer. Dogs travel on the outer decks on a lead;",
        "assistance dogs may go anywhere on board. Every ship has a lift, and",
        "staff help passengers in wheelchairs when they book help a day ahead.",
        "Sailings are cancelled when the wind passes force eight; passengers of",
        "a cancelled sailing may take the next one or get their money back in",
        "full within thirty days. Luggage is free up to two bags of twenty kilos",
        "each; more costs five euros a bag. Lost property is kept for ninety days",
        "at the port where the ship ended its trip. Season tickets exist for",
        "islanders and for commuters who cross at least four days a week; they",
        "are sold at the ticket offices only, with a photo and proof of address.",
        "Food and drink are sold on board from the first sailing to the last;",
        "the cafe takes cards only. Smoking is allowed nowhere on board, vaping",
        "neither. Ports open their waiting rooms an hour before the first",
        "sailing and close them half an hour after the last. Parking at the",
        "mainland port costs eight euros a day; island ports have free parking",
        "for up to three days. Passengers must be at the gate fifteen minutes",
        "before sailing with a car, and ten minutes on foot. Complaints go to",
        "the customer office by mail or through the website's form; they are",
        "answered within ten working days.",
    ]
)

QUESTIONS = [
    "Can I bring my bicycle on the ferry?",
    "How much does a ticket cost for my six-year-old?",
    "What happens if my sailing is cancelled because of wind?",
    "Is there food on board?",
    "Can my dog come with me inside?",
    "Where do I park at the mainland port, and how much is it?",
    "I lost my umbrella on yesterday's boat. Where is it now?",
    "Do you give discounts to students?",
    "How early should I be at the gate with my car?",
    "Can I pay on board with cash?",
    "How do I complain about rude staff?",
    "We are twelve people travelling together. Is there a discount?",
    "How much luggage can I take for free?",
    "When does the waiting room open in the morning?",
    "Is there a lift for my grandmother's wheelchair?",
    "How long does a refund take when I bought the ticket online?",
    "Can I smoke on the outer deck?",
    "What is a season ticket and who can get one?",
    "Where are the life jackets?",
    "Do I need to book my motorbike ahead in August?",
]


@dataclass
class Turn:
    user: int
    turn: int
    started: float
    pass_number: int = 1
    first_token_s: float | None = None
    ended: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Roundhouse's engine's own part of the time to first token.
    engine_first_token_s: float | None = None
    error: str = ""


@dataclass
class Run:
    server: str
    turns: list[Turn] = field(default_factory=list)
    # Each pass's wall time (pass 1 first).
    walls: list[float] = field(default_factory=list)

    def of_pass(self, number: int) -> "Run":
        """The turns of one pass, as a run of their own."""
        return Run(
            f"{self.server} pass {number}",
            [t for t in self.turns if t.pass_number == number],
            [self.walls[number - 1]],
        )

    @property
    def wall_s(self) -> float:
        return sum(self.walls)


# -- one streamed chat completion ---------------------------------------------------


async def stream_chat(
    port: int, key: str, messages: list[dict], args, record: Turn
) -> str:
    """POST a streamed chat completion; fills `record`; returns the answer."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": args.answer_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reader, writer, status = await http_open(
        port, "POST", "/v1/chat/completions", key=key, body=body
    )
    try:
        if status != 200:
            record.error = f"HTTP {status}: {(await reader.read())[:200]!r}"
            return ""
        parts = []
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                record.error = str(event["error"])[:200]
                return ""
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if record.first_token_s is None:
                        record.first_token_s = time.monotonic() - record.started
                    parts.append(text)
            usage = event.get("usage")
            if usage:
                record.completion_tokens = usage.get("completion_tokens", 0)
                record.prompt_tokens = usage.get("prompt_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens") or 0
            timings = event.get("timings")  # llama-server's, or Roundhouse's
            if timings and not record.cached_tokens:
                record.cached_tokens = timings.get("cache_n", 0)
            if timings and timings.get("engine_first_token_ms") is not None:
                record.engine_first_token_s = timings["engine_first_token_ms"] / 1000
        return "".join(parts)
    finally:
        writer.close()


async def user(
    index: int, port: int, key: str, args, run: Run, pass_number: int
) -> None:
    chooser = random.Random(SEED + index)
    await asyncio.sleep(chooser.random())  # arrivals spread over the first second
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    questions = chooser.sample(QUESTIONS, args.turns)
    for number, question in enumerate(questions, start=1):
        messages.append({"role": "user", "content": question})
        record = Turn(index, number, time.monotonic(), pass_number)
        try:
            answer = await asyncio.wait_for(
                stream_chat(port, key, messages, args, record), TIMEOUT_S
            )
        except (TimeoutError, OSError, ValueError) as error:
            record.error = repr(error)[:200]
            answer = ""
        record.ended = time.monotonic()
        run.turns.append(record)
        if record.error:
            return  # this user gives up
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(0.5 + chooser.random())


async def conversations(server: str, port: int, key: str, args) -> Run:
    """Every user's conversation, `args.passes` times over: a later pass sends
    the same conversations again (the same questions; greedy, so the same
    answers), as people come back to a chat, with the server's caches warm."""
    run = Run(server)
    for pass_number in range(1, args.passes + 1):
        begin = time.monotonic()
        await asyncio.gather(
            *(
                user(index, port, key, args, run, pass_number)
                for index in range(args.users)
            )
        )
        run.walls.append(time.monotonic() - begin)
    return run


# -- the servers --------------------------------------------------------------------


# What each Roundhouse variant changes in the admin before it starts: nothing
# (a fresh `make run`: SmolLM2's 32 slots with a KV stream each), the model's
# prompt cache off (the cache's control), or the KV budget of before
# 2026-12-08 (1,024 MiB, under every slot's whole context), which gives KV
# groups instead of a stream per slot.
VARIANTS = {
    "roundhouse": "",
    "roundhouse-nocache": (
        "from catalog.models import ModelConfig\n"
        f"ModelConfig.objects.filter(name={MODEL!r}).update(prompt_cache=False)"
    ),
    "roundhouse-groups": (
        "from fleet.models import ConcurrencySettings\n"
        "limits = ConcurrencySettings.load()\n"
        "limits.kv_cache_mib = 1024\n"
        "limits.save()"
    ),
}


def run_roundhouse(args, name: str) -> Run:
    with tempfile.TemporaryDirectory(prefix="roundhouse-chat-") as run_dir:
        platform = Platform(Path(run_dir))
        try:
            if VARIANTS[name]:
                platform.manage("migrate", "--noinput")
                platform.manage("shell", "-c", VARIANTS[name])
            platform.startup([])
            print(f"{name}: running", flush=True)
            return asyncio.run(conversations(name, platform.port, platform.key, args))
        finally:
            platform.stop()


def run_llama_server(args, binary: str, *, tuned: bool) -> Run:
    """llama.cpp's server on the same GGUF file and thread count: with its own
    defaults, or `tuned` to Roundhouse's default shape for the model (its
    slots, and a context of their whole KV pool: `-np SLOTS -c POOL`)."""
    port = free_port()
    name = "llama-server-tuned" if tuned else "llama-server"
    with tempfile.TemporaryDirectory(prefix="llama-server-") as log_dir:
        log = open(Path(log_dir) / "server.log", "wb")  # noqa: SIM115
        argv = [binary, "-m", str(MODEL_PATH), "--host", "127.0.0.1"]
        argv += ["--port", str(port), "-t", str(THREADS), "--no-webui"]
        if tuned:
            argv += ["-np", str(args.tuned_slots), "-c", str(args.tuned_context)]
        process = subprocess.Popen(argv, stdout=log, stderr=log)
        try:
            wait_http(port, process, "/health")
            print(f"{name}: running", flush=True)
            return asyncio.run(conversations(name, port, "", args))
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()
            if args.keep_logs:
                print((Path(log_dir) / "server.log").read_text()[-3000:])


# -- report -------------------------------------------------------------------------


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def turn_p50(run: Run, turn: int) -> float:
    values = [t.first_token_s for t in run.turns if t.turn == turn and t.first_token_s]
    return statistics.median(values) if values else float("nan")


def tokens_per_s(run: Run) -> float:
    return sum(t.completion_tokens for t in run.turns) / run.wall_s


def inter_token_ms(run: Run, turn: int) -> float:
    """The p50 of a turn's mean interval between tokens after its first: the
    time each of its tokens waited on the server's steps."""
    values = [
        (t.ended - t.started - t.first_token_s) / (t.completion_tokens - 1) * 1000
        for t in run.turns
        if t.turn == turn and t.first_token_s and t.completion_tokens > 1
    ]
    return statistics.median(values) if values else float("nan")


def work_report(runs: list[Run], args) -> None:
    """Where each pass's time went: the prompt tokens the server evaluated
    (sent less cached), the tokens it generated, both together a second of
    the pass's wall time, and each turn's p50 interval between tokens."""
    width = 28
    print(
        f"{'work':<{width}}{'evaluated':>10}{'generated':>10}{'processed/s':>12}"
        + "".join(f"{'t' + str(n) + ' itl ms':>11}" for n in range(1, args.turns + 1))
    )
    for whole in runs:
        for number in range(1, len(whole.walls) + 1):
            run = whole.of_pass(number)
            evaluated = sum(t.prompt_tokens - t.cached_tokens for t in run.turns)
            generated = sum(t.completion_tokens for t in run.turns)
            line = f"{run.server:<{width}}{evaluated:>10}{generated:>10}"
            line += f"{(evaluated + generated) / run.wall_s:>12.1f}"
            line += "".join(
                f"{inter_token_ms(run, turn):>11.0f}"
                for turn in range(1, args.turns + 1)
            )
            print(line)


def anchor_of(by_name: dict[str, Run]) -> Run | None:
    return by_name.get("llama-server-tuned") or by_name.get("llama-server")


def ratios(runs: list[Run], turns: int) -> list[tuple[int, float, list[float]]]:
    """Each pass's Roundhouse / anchor ratios: tokens/s, and each turn's p50
    time to first token, turns 1 to `turns` each (nan where a turn has no
    first token: every round's list is as long, for the median of rounds);
    none without both servers."""
    by_name = {run.server: run for run in runs}
    ours, anchor = by_name.get("roundhouse"), anchor_of(by_name)
    if not (ours and anchor):
        return []
    found = []
    for number in range(1, min(len(ours.walls), len(anchor.walls)) + 1):
        mine, theirs = ours.of_pass(number), anchor.of_pass(number)
        found.append(
            (
                number,
                tokens_per_s(mine) / tokens_per_s(theirs),
                [
                    turn_p50(mine, turn) / turn_p50(theirs, turn)
                    for turn in range(1, turns + 1)
                ],
            )
        )
    return found


def rounds_report(rounds: list[list[Run]], turns: int) -> None:
    """Each round's ratios and their median: one run's moves by several per
    cent on a shared machine (either server's second pass by up to 10%)."""
    print("\n== every round: roundhouse / anchor ==")
    found = [ratios(runs, turns) for runs in rounds]
    for number in range(1, max((len(r) for r in found), default=0) + 1):
        tokens = [r[number - 1][1] for r in found if len(r) >= number]
        ttft = [r[number - 1][2] for r in found if len(r) >= number]
        print(
            f"pass {number}: tokens/s "
            + ", ".join(f"{value:.2f}" for value in tokens)
            + f" (median {statistics.median(tokens):.2f}); p50 TTFT per turn, "
            "median of the rounds: "
            + ", ".join(
                f"t{turn} {statistics.median(values):.2f}"
                for turn, values in enumerate(zip(*ttft, strict=True), 1)
            )
        )


def report(runs: list[Run], args) -> None:
    print(
        f"\n{args.users} users x {args.turns} turns x {args.passes} passes, "
        f"~400-token system prompt, answers of at most {args.answer_tokens} "
        f"tokens, greedy, SSE; {THREADS} threads, {os.cpu_count()} cores shared "
        "by everything"
    )
    width = 28
    header = f"{'server':<{width}}{'tok/s':>7}{'errors':>7}{'prompt':>8}{'cached':>8}"
    header += "".join(
        f"{'t' + str(n) + ' p50/p99 s':>15}" for n in range(1, args.turns + 1)
    )
    print(header)
    for whole in runs:
        for number in range(1, len(whole.walls) + 1):
            run = whole.of_pass(number)
            errors = sum(bool(t.error) for t in run.turns)
            prompt = sum(t.prompt_tokens for t in run.turns)
            cached = sum(t.cached_tokens for t in run.turns)
            line = f"{run.server:<{width}}{tokens_per_s(run):>7.1f}{errors:>7}"
            line += f"{prompt:>8}{cached / prompt if prompt else 0:>8.0%}"
            for turn in range(1, args.turns + 1):
                values = [
                    t.first_token_s
                    for t in run.turns
                    if t.turn == turn and t.first_token_s
                ]
                p50, p99 = statistics.median(values or [0]), percentile(values, 0.99)
                line += f"{p50:>8.2f}/{p99:<6.2f}" if values else f"{'-':>15}"
            print(line)
            engine = [
                statistics.median(parts)
                for turn in range(1, args.turns + 1)
                if (
                    parts := [
                        t.engine_first_token_s
                        for t in run.turns
                        if t.turn == turn and t.engine_first_token_s is not None
                    ]
                )
            ]
            if engine:
                print(
                    f"{'  engine part p50 s':<{width + 30}}"
                    + "".join(f"{value:>8.2f}{'':7}" for value in engine)
                )
            for sample in [t.error for t in run.turns if t.error][:3]:
                print(f"    error: {sample}")
    work_report(runs, args)
    by_name = {run.server: run for run in runs}
    ours, off = by_name.get("roundhouse"), by_name.get("roundhouse-nocache")
    anchor = anchor_of(by_name)
    print()
    for number, tokens, ttft in ratios(runs, args.turns):
        goal = "1.2" if number == 1 else "1.0"
        print(
            f"pass {number}: tokens/s, roundhouse / {anchor.server}: "
            f"{tokens:.2f} (goal >= {goal}); p50 TTFT per turn: "
            + ", ".join(f"t{turn} {value:.2f}" for turn, value in enumerate(ttft, 1))
            + " (goal <= 1.0 each)"
        )
    if ours and off:
        last = args.turns
        print(
            f"turn-{last} p50 TTFT, cache on / off (pass 1): "
            f"{turn_p50(ours.of_pass(1), last) / turn_p50(off.of_pass(1), last):.2f}"
            " (goal <= 0.25)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument(
        "--passes", type=int, default=2, help="the same conversations, again"
    )
    # Roundhouse's default shape for the bundled SmolLM2 (a fresh `make run`:
    # 32 auto slots of 2,048 tokens, a KV stream each): llama-server tuned to it.
    parser.add_argument("--tuned-slots", type=int, default=32)
    parser.add_argument("--tuned-context", type=int, default=65536)
    parser.add_argument(
        "--only",
        nargs="*",
        choices=[*LLAMA_SERVERS, *VARIANTS],
        help="run only these servers (default: all but llama-server's defaults "
        "and roundhouse-nocache)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the servers this many times in turn and report each round's "
        "ratios and their median (one run's move by several per cent here)",
    )
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--dump", metavar="FILE", help="write every turn's record as JSON lines"
    )
    args = parser.parse_args()
    if args.turns > len(QUESTIONS):
        parser.error(f"at most {len(QUESTIONS)} turns")
    wanted = args.only or ["llama-server-tuned", "roundhouse"]
    binary = os.environ.get("ROUNDHOUSE_LLAMA_SERVER")
    rounds = []
    for number in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"\n== round {number} of {args.rounds} ==")
        runs: list[Run] = []
        for name in LLAMA_SERVERS:
            if name not in wanted:
                continue
            if binary:
                tuned = name.endswith("tuned")
                runs.append(run_llama_server(args, binary, tuned=tuned))
                report(runs, args)  # as it goes: a run takes minutes
            else:
                print(f"ROUNDHOUSE_LLAMA_SERVER not set: {name} is left out")
        for name in VARIANTS:
            if name in wanted:
                runs.append(run_roundhouse(args, name))
                report(runs, args)
        rounds.append(runs)
    print("\n== all servers ==")
    for runs in rounds:
        report(runs, args)
    if args.rounds > 1:
        rounds_report(rounds, args.turns)
    if args.dump:
        with open(args.dump, "w", encoding="utf-8") as out:
            for number, runs in enumerate(rounds, 1):
                for run in runs:
                    for record in run.turns:
                        line = {"server": run.server, "round": number, **vars(record)}
                        out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
