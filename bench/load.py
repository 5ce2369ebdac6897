"""The reliability bench's load: streaming chat clients through the front (SSE on
/v1/chat/completions, or the WebSocket chat), each request classified by how
it ended, and the platform's recovery from a fault measured from those outcomes.

No benchmark of its own: bench/reliability.py runs this load around its faults.
"""

import asyncio
import contextlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import connect as ws_connect  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from bench.front import MODEL, http_open  # noqa: E402

SUCCEEDED, RATE_LIMITED, ERROR, LOST, HUNG_UP = (
    "succeeded",
    "429",
    "error",
    "lost",
    "hung up",
)
BEFORE_FAULT_S = 5.0  # load before each fault
STABLE_S = 3.0  # recovered: this long since the first success after the last failure
PAUSE_S = 0.25  # each client's pause between requests
MAX_REQUESTS = 800  # per scenario, whatever happens
CLIENT_TIMEOUT_S = 60.0  # a request with no answer by then is lost


# -- outcomes and recovery --------------------------------------------------------


@dataclass
class Outcome:
    """One request: when it started and ended (monotonic seconds), how it ended."""

    started: float
    ended: float
    kind: str
    detail: str = ""
    headers: float | None = None  # the status line arrived
    first_token: float | None = None


@dataclass
class Result:
    """One scenario's requests and what was seen of the platform."""

    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    fault_at: float | None = None
    recovery_s: float | None = None
    failed: bool = False  # some request after the fault did not succeed
    leases: str = ""
    rss: str = ""
    notes: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(outcome.kind == kind for outcome in self.outcomes)

    def latencies_ms(self) -> list[float]:
        return sorted(
            (outcome.ended - outcome.started) * 1000
            for outcome in self.outcomes
            if outcome.kind == SUCCEEDED
        )


def first_recovered(
    outcomes: list[Outcome], fault_at: float
) -> tuple[bool, Outcome | None]:
    """(whether any request ending after the fault failed, the first request
    started after the last failed one that succeeded, if any yet)."""
    after = [o for o in outcomes if o.ended > fault_at and o.kind != HUNG_UP]
    failed = [o for o in after if o.kind != SUCCEEDED]
    if not failed:
        return False, None
    since = max(fault_at, max(o.started for o in failed))
    later = [o for o in after if o.kind == SUCCEEDED and o.started >= since]
    return True, min(later, key=lambda o: o.ended, default=None)


def recovery_time(outcomes: list[Outcome], fault_at: float) -> tuple[bool, float]:
    """(whether any request failed after the fault, seconds from the fault until
    the first request started after the last failed one succeeded: 0 if none
    failed, nan if none has succeeded yet)."""
    failed, first = first_recovered(outcomes, fault_at)
    if not failed:
        return False, 0.0
    return True, (first.ended - fault_at) if first else float("nan")


# -- one request ------------------------------------------------------------------


class Timing:
    """One request's clock: when it started, when it passed its milestones
    (`seen`: headers, first_token), and its outcome once it `ended`."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seen: dict[str, float] = {}

    def ended(self, kind: str, detail: str = "") -> Outcome:
        return Outcome(
            self.started,
            time.monotonic(),
            kind,
            detail,
            self.seen.get("headers"),
            self.seen.get("first_token"),
        )


def _error_code(body: bytes) -> str:
    found = re.search(rb'"code":\s*"([^"]*)"', body)
    return found.group(1).decode() if found else ""


async def chat_stream(
    port: int, key: str, index: int, *, tokens: int, hang_up_after: int = 0
) -> Outcome:
    """One streamed chat completion through the front, classified. Not
    `bench.generation.sse_events`: it cannot tell `[DONE]` from a stream that
    just stopped, which is what tells a complete answer from a lost one."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Name {index % 7 + 2} colours."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    timing = Timing()
    seen, ended = timing.seen, timing.ended

    try:
        reader, writer, status = await http_open(
            port, "POST", "/v1/chat/completions", key=key, body=body
        )
    except (OSError, TimeoutError) as error:
        return ended(ERROR, f"connect: {type(error).__name__}")
    except (IndexError, ValueError, asyncio.IncompleteReadError):
        return ended(LOST, "closed before a status")
    seen["headers"] = time.monotonic()
    try:
        if status != 200:
            code = _error_code(await reader.read())
            if status == 429:
                return ended(RATE_LIMITED, code)
            return ended(ERROR, f"{status} {code}")
        content, finish = 0, None
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                if finish is None:
                    return ended(LOST, "[DONE] without a finish_reason")
                return ended(SUCCEEDED, finish)
            event = json.loads(data)
            if "error" in event:
                return ended(ERROR, f"mid-stream {event['error'].get('code')}")
            for choice in event.get("choices") or []:
                if choice.get("delta", {}).get("content"):
                    content += 1
                    seen.setdefault("first_token", time.monotonic())
                finish = choice.get("finish_reason") or finish
            if hang_up_after and content >= hang_up_after:
                return ended(HUNG_UP, f"after {content} tokens")
        return ended(LOST, "stream ended without [DONE]")
    except OSError as error:
        return ended(ERROR, f"mid-stream {type(error).__name__}")
    finally:
        writer.close()


async def ws_chat_stream(
    port: int, key: str, index: int, *, tokens: int, hang_up_after: int = 0
) -> Outcome:
    """The same chat through the WebSocket chat (a socket per request, as a
    client that reconnects), classified the same way: `done` with a finish
    reason succeeded; `error` with status 429 is a 429, any other an error; a
    socket that closes before either lost the request."""
    chat = {
        "type": "chat",
        "id": str(index),
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Name {index % 7 + 2} colours."}],
        "params": {"max_tokens": tokens, "temperature": 0},
    }
    timing = Timing()
    seen, ended = timing.seen, timing.ended

    try:
        socket = await ws_connect(f"ws://127.0.0.1:{port}/ws/chat/")
    except (OSError, TimeoutError) as error:
        return ended(ERROR, f"connect: {type(error).__name__}")
    try:
        await socket.send(json.dumps({"type": "auth", "key": key}))
        ready = json.loads(await socket.recv())
        if ready.get("type") != "ready":
            return ended(ERROR, f"not ready: {ready}")
        await socket.send(json.dumps(chat))
        content = 0
        while True:
            message = json.loads(await socket.recv())
            kind = message["type"]
            if kind == "start":
                seen["headers"] = time.monotonic()
            elif kind == "token" and message["text"]:
                content += 1
                seen.setdefault("first_token", time.monotonic())
                if hang_up_after and content >= hang_up_after:
                    return ended(HUNG_UP, f"after {content} tokens")
            elif kind == "done":
                return ended(SUCCEEDED, message["finish_reason"])
            elif kind == "error":
                if message.get("status") == 429:
                    return ended(RATE_LIMITED, message["code"])
                where = "mid-stream " if "headers" in seen else ""
                return ended(ERROR, f"{where}{message['status']} {message['code']}")
    except ConnectionClosed as closed:
        return ended(
            LOST, f"socket closed ({closed.rcvd.code if closed.rcvd else '-'})"
        )
    finally:
        await socket.close()


async def bounded_stream(
    port: int,
    key: str,
    index: int,
    *,
    tokens: int,
    timeout: float,
    hang_up_after=0,
    transport: str = "sse",
) -> Outcome:
    started = time.monotonic()
    client = ws_chat_stream if transport == "ws" else chat_stream
    try:
        async with asyncio.timeout(timeout):
            return await client(
                port, key, index, tokens=tokens, hang_up_after=hang_up_after
            )
    except TimeoutError:
        return Outcome(started, time.monotonic(), LOST, f"no end in {timeout:g} s")


# -- the clients ------------------------------------------------------------------


class Load:
    """`clients` clients streaming through the front on `port` with `key`, and
    the requests' numbering (a request's prompt follows from its number)."""

    def __init__(
        self, port: int, key: str, *, tokens: int, clients: int, transport="sse"
    ) -> None:
        self.port = port
        self.transport = transport  # "sse" or "ws"
        self.key = key
        self.tokens = tokens
        self.clients = clients
        self.index = 0

    def stream(self, *, timeout: float, hang_up_after: int = 0) -> Awaitable[Outcome]:
        """The next request, numbered when it is made rather than when it runs."""
        self.index += 1
        return bounded_stream(
            self.port,
            self.key,
            self.index,
            tokens=self.tokens,
            timeout=timeout,
            hang_up_after=hang_up_after,
            transport=self.transport,
        )

    async def client_loop(self, result: Result, stop: asyncio.Event) -> None:
        while not stop.is_set() and len(result.outcomes) < MAX_REQUESTS:
            outcome = await self.stream(timeout=CLIENT_TIMEOUT_S)
            result.outcomes.append(outcome)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PAUSE_S)

    async def around_fault(
        self,
        name: str,
        inject: Callable[[Result], Awaitable[None]],
        *,
        watch_at_least_s: float,
        deadline_s: float,
        overdue: Callable[[Result], Awaitable[float]] | None = None,
        cleanup: Callable[[], Awaitable[None]] | None = None,
    ) -> Result:
        """Clients stream before, during and after `inject`, until the platform
        has recovered (and at least `watch_at_least_s` has passed) or
        `deadline_s` after the fault; `overdue` runs once at the deadline if it
        has not recovered, and returns seconds more to watch."""
        result = Result(name)
        stop = asyncio.Event()
        clients = [
            asyncio.create_task(self.client_loop(result, stop))
            for _ in range(self.clients)
        ]
        try:
            await asyncio.sleep(BEFORE_FAULT_S)
            result.fault_at = time.monotonic()
            await inject(result)
            deadline = result.fault_at + deadline_s
            while True:
                await asyncio.sleep(0.25)
                now = time.monotonic()
                _, recovery = recovery_time(result.outcomes, result.fault_at)
                settled = recovery == recovery and (
                    now >= result.fault_at + recovery + STABLE_S
                )
                if settled and now >= result.fault_at + watch_at_least_s:
                    break
                if now >= deadline or len(result.outcomes) >= MAX_REQUESTS:
                    more = await overdue(result) if overdue else 0.0
                    overdue = None
                    if not more:
                        break
                    deadline = now + more
        finally:
            stop.set()
            await asyncio.gather(*clients)
            if cleanup:
                await cleanup()
        result.failed, recovery = recovery_time(result.outcomes, result.fault_at)
        caught = Counter(
            f"{o.kind} {o.detail}".strip()
            for o in result.outcomes
            if o.started < result.fault_at < o.ended
        )
        result.notes.append(
            f"{sum(caught.values())} requests in flight at the fault, ended: "
            + (", ".join(f"{what} x{n}" for what, n in caught.items()) or "-")
        )
        result.recovery_s = None if recovery != recovery else recovery
        _, first = first_recovered(result.outcomes, result.fault_at)
        if first is not None:
            token = first.first_token or first.ended
            result.notes.append(
                f"first success after the last failure: started "
                f"+{first.started - result.fault_at:.1f} s, first token "
                f"+{token - result.fault_at:.1f} s, done "
                f"+{first.ended - result.fault_at:.1f} s"
            )
        return result
