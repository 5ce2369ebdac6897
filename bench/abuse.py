"""The reliability bench's abuse scenario: one account floods the WebSocket chat
while other people chat; how much later do the others' answers start?

No benchmark of its own: bench/reliability.py runs it (`--only abuse` runs it
alone). Users are logged in as a browser is (a session in the platform's
database, its cookie on the socket), so they are admitted on the User limits
in the admin (defaults: 60 messages a minute, 4 engine requests at once, over
all of a user's sockets; a message with n choices counts n).

- The others: `--users` people, each on a socket of their own, asking a short
  question (greedy, at most `--tokens` tokens), reading the whole answer,
  then thinking THINK_S before the next.
- The abuser: one account on ABUSER_SOCKETS sockets, each keeping
  `--abuse-streams` streams in flight, each with n choices of at most
  ABUSER_TOKENS tokens, sending the next PAUSE_S after one ends, refused or
  not (it ignores retry_after).

Phases, each PHASE_S long with the others chatting throughout: the others
alone (the anchor), with the abuser at n=8 (the issue's abuse: with the
default limits each such message weighs more than the whole allowance and is
refused with a 400), with the abuser at n=4 (one that fits its messages to
the allowance), with the abuser at n=8 on an override of 0 / 0 (unlimited:
what every logged-in user had before users had limits), and the others
alone again (how much the machine drifted). Reported per phase: the others'
p50 and p90 time to first token (their `chat` message to the first
non-empty token), its ratio to the anchor (goal: <= 1.5 with the default
limits), the others' refusals, and what the abuser got.
"""

import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import connect as ws_connect  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from bench.front import MODEL, Platform  # noqa: E402
from bench.load import ERROR, LOST, RATE_LIMITED, SUCCEEDED, Outcome  # noqa: E402

PHASE_S = 30.0
THINK_S = 1.0  # a person reads the answer, then types the next question
ABUSER = "abuser"
ABUSER_SOCKETS = 8
ABUSER_TOKENS = 128
PAUSE_S = 0.25  # the abuser's pause after a stream ends, whatever the end
ANSWER_TIMEOUT_S = 90.0
GOAL_RATIO = 1.5


@dataclass
class Phase:
    """One phase's outcomes: the others' turns, and the abuser's streams."""

    name: str
    others: list[Outcome] = field(default_factory=list)
    abuser: Counter = field(default_factory=Counter)

    def ttfts_ms(self) -> list[float]:
        return sorted(
            (o.first_token - o.started) * 1000
            for o in self.others
            if o.kind == SUCCEEDED and o.first_token is not None
        )


def sessions(platform: Platform, names: list[str]) -> dict[str, str]:
    """Users of these names, each logged in: their session cookies, by name."""
    output = platform.manage(
        "shell",
        "-c",
        "from django.contrib.auth import get_user_model\n"
        "from django.test import Client\n"
        f"for name in {names!r}:\n"
        "    user, _ = get_user_model().objects.get_or_create(username=name)\n"
        "    client = Client()\n"
        "    client.force_login(user)\n"
        "    print('session', name, client.cookies['sessionid'].value)\n",
    )
    return {
        parts[1]: parts[2]
        for line in output.splitlines()
        if (parts := line.split()) and parts[0] == "session"
    }


def user_limits_set(
    platform: Platform, name: str, *, rpm_limit: int, max_concurrent: int
) -> None:
    """Give the user their own limits, as the admin's User limits page does.
    The front reads them again within seconds."""
    platform.manage(
        "shell",
        "-c",
        "from django.contrib.auth import get_user_model\n"
        "from api.models import UserLimitOverride, UserLimits\n"
        f"user = get_user_model().objects.get(username={name!r})\n"
        "UserLimitOverride.objects.update_or_create(user=user, defaults={"
        "'defaults': UserLimits.load(), "
        f"'rpm_limit': {rpm_limit}, 'max_concurrent': {max_concurrent}}})\n",
    )


def user_limits_reset(platform: Platform, name: str) -> None:
    platform.manage(
        "shell",
        "-c",
        "from api.models import UserLimitOverride\n"
        f"UserLimitOverride.objects.filter(user__username={name!r}).delete()\n",
    )


async def session_socket(port: int, session: str):
    socket = await ws_connect(
        f"ws://127.0.0.1:{port}/ws/chat/",
        additional_headers={"Cookie": f"sessionid={session}"},
        max_size=None,
    )
    ready = json.loads(await socket.recv())
    if ready.get("type") != "ready":
        raise RuntimeError(f"not ready: {ready}")
    return socket


def message(stream_id: str, *, tokens: int, n: int = 1, content: str) -> str:
    params = {"max_tokens": tokens, "temperature": 0}
    if n > 1:
        params["n"] = n
    return json.dumps(
        {
            "type": "chat",
            "id": stream_id,
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "params": params,
        }
    )


async def person(
    port: int, session: str, index: int, tokens: int, phase: Phase, stop
) -> None:
    """One of the others: ask, read the whole answer, think, ask again."""
    socket = await session_socket(port, session)
    turn = 0
    try:
        while not stop.is_set():
            turn += 1
            stream_id = f"{index}-{turn}"
            started = time.monotonic()
            first, kind, detail = None, LOST, ""
            await socket.send(
                message(
                    stream_id,
                    tokens=tokens,
                    content=f"Name {(index + turn) % 7 + 2} colours.",
                )
            )
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT_S):
                    while True:
                        reply = json.loads(await socket.recv())
                        if reply.get("id") != stream_id:
                            continue  # a `stored` of the turn before
                        if reply["type"] == "token" and reply["text"]:
                            first = first or time.monotonic()
                        elif reply["type"] == "done":
                            kind, detail = SUCCEEDED, reply["finish_reason"]
                            break
                        elif reply["type"] == "error":
                            kind = RATE_LIMITED if reply["status"] == 429 else ERROR
                            detail = reply["code"]
                            break
            except TimeoutError:
                detail = f"no end in {ANSWER_TIMEOUT_S:g} s"
            phase.others.append(
                Outcome(started, time.monotonic(), kind, detail, None, first)
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), THINK_S)
    finally:
        await socket.close()


async def abuser_socket(
    port: int, session: str, index: int, args, n: int, phase: Phase, stop
) -> None:
    """One of the abuser's sockets: `--abuse-streams` streams in flight, the
    next sent PAUSE_S after one ends."""
    socket = await session_socket(port, session)
    sent = 0
    running: set[str] = set()

    def send_next():
        nonlocal sent
        sent += 1
        stream_id = f"x{index}-{sent}"
        running.add(stream_id)
        content = "Write a very long essay about the sea."
        return socket.send(
            message(stream_id, tokens=ABUSER_TOKENS, n=n, content=content)
        )

    try:
        for _ in range(args.abuse_streams):
            await send_next()
        while not stop.is_set():
            try:
                reply = json.loads(await asyncio.wait_for(socket.recv(), 1.0))
            except TimeoutError:
                continue
            kind = reply["type"]
            if kind == "start":  # every choice has its slot
                phase.abuser["started"] += 1
                phase.abuser["engine requests"] += n
            elif kind in ("done", "error") and reply["id"] in running:
                running.discard(reply["id"])
                if kind == "error":
                    phase.abuser[f"{reply['status']} {reply['code']}"] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), PAUSE_S)
                if not stop.is_set():
                    await send_next()
    except ConnectionClosed as closed:
        phase.abuser[f"socket closed {closed.rcvd.code if closed.rcvd else '-'}"] += 1
    finally:
        await socket.close()  # its streams are cancelled in the engine


async def run_phase(
    platform: Platform, cookies: dict[str, str], args, name: str, abuse_n: int
) -> Phase:
    """The others chat for PHASE_S; the abuser too when `abuse_n`."""
    phase = Phase(name)
    stop = asyncio.Event()
    tasks = []
    if abuse_n:
        tasks += [
            asyncio.create_task(
                abuser_socket(
                    platform.port, cookies[ABUSER], i, args, abuse_n, phase, stop
                )
            )
            for i in range(ABUSER_SOCKETS)
        ]
        await asyncio.sleep(2)  # the abuser is at it before the others start
    tasks += [
        asyncio.create_task(
            person(platform.port, cookies[f"user{i}"], i, args.tokens, phase, stop)
        )
        for i in range(args.users)
    ]
    await asyncio.sleep(args.phase_s)
    stop.set()
    await asyncio.gather(*tasks)
    return phase


async def abuse(bench) -> list[Phase]:
    """Every phase, one after the other, the engine idle between them."""
    platform, args = bench.platform, bench.args
    names = [ABUSER, *(f"user{i}" for i in range(args.users))]
    cookies = await asyncio.to_thread(sessions, platform, names)
    phases = []
    # Each abuse phase right after an anchor of its own: on a machine shared
    # with other work the anchor drifts from one minute to the next.
    plan = [
        ("others alone", 0, None),
        ("abuser n=8, default limits", 8, None),
        ("others alone", 0, None),
        ("abuser n=4, default limits", 4, None),
        ("others alone", 0, None),
        ("abuser n=8, unlimited (0/0)", 8, (0, 0)),
    ]
    for name, abuse_n, override in plan:
        if override is not None:
            await asyncio.to_thread(
                user_limits_set,
                platform,
                ABUSER,
                rpm_limit=override[0],
                max_concurrent=override[1],
            )
            await asyncio.sleep(6)  # the front reads users' limits every 5 s
        phases.append(await run_phase(platform, cookies, args, name, abuse_n))
        if override is not None:
            await asyncio.to_thread(user_limits_reset, platform, ABUSER)
        waited = await bench.until_idle()
        print(
            f"  abuse: {name}: {len(phases[-1].others)} turns; engine idle "
            f"{waited:.0f} s after",
            flush=True,
        )
    return phases


def report(phases: list[Phase], args) -> None:
    """The others' time to first token per phase, against the anchor: the
    phase of the others alone just before it."""
    print(
        f"\nabuse: {args.users} users chatting (n=1, max_tokens {args.tokens}, "
        f"{THINK_S:g} s between turns) for {args.phase_s:g} s per phase; the "
        f"abuser: one account, {ABUSER_SOCKETS} sockets x {args.abuse_streams} "
        f"streams, max_tokens {ABUSER_TOKENS}"
    )
    print(
        f"{'phase':<30}{'turns':>6}{'ok':>5}{'refused':>8}{'p50 TTFT':>10}"
        f"{'p90':>8}{'x anchor':>9}  abuser"
    )
    ratios = {}
    for phase in phases:
        ttfts = phase.ttfts_ms()
        p50 = statistics.median(ttfts) if ttfts else float("nan")
        if not phase.abuser and "alone" in phase.name:
            anchor = p50
        ratios[phase.name] = p50 / anchor
        p90 = ttfts[int(0.9 * len(ttfts))] if ttfts else float("nan")
        ok = sum(o.kind == SUCCEEDED for o in phase.others)
        refused = Counter(
            f"{o.kind} {o.detail}" for o in phase.others if o.kind != SUCCEEDED
        )
        abuser = ", ".join(f"{k} {v}" for k, v in sorted(phase.abuser.items()))
        print(
            f"{phase.name:<30}{len(phase.others):>6}{ok:>5}"
            f"{sum(refused.values()):>8}{p50:>10.0f}{p90:>8.0f}"
            f"{ratios[phase.name]:>9.2f}  {abuser or '-'}"
        )
        if refused:
            print(f"{'':<30}the others refused: {dict(refused)}")
    worst = max(ratio for name, ratio in ratios.items() if "default" in name)
    verdict = "met" if worst <= GOAL_RATIO else "NOT met"
    print(
        f"goal: with the default user limits the others' p50 time to first "
        f"token is <= {GOAL_RATIO:g}x the anchor's (the others alone just "
        f"before): {verdict} ({worst:.2f}x at worst)"
    )
