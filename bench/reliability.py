"""Reliability: SSE chat streams through faults in the engine, the supervisor and
the database, and a burst of streams whose clients hang up.

Run: .venv/bin/python bench/reliability.py [--tokens 16] [--clients 4] [--keep]
     [--only SCENARIO ...]

Starts a platform of its own, as bench/front.py does (its `Platform`: a
temporary run dir, the seed engine cpu0, the bundled models, a fresh API key,
`manage.py supervise` and the front on loopback), on a fresh PostgreSQL database
(`--postgres`, default postgres@127.0.0.1:5432; created for the run and dropped
at its end), so that the database can be taken away. Every scenario but the last
runs `--clients` clients, each streaming greedy chat answers of at most
`--tokens` tokens from smollm2-135m-instruct one after another, before, during
and after one fault:

  engine SIGKILL       kill -9 the engine while streams are mid-flight
  engine SIGKILL (WS)  the same, the clients on the WebSocket chat
  engine SIGSTOP       kill -STOP the engine (the supervisor replaces an engine
                       silent for 15 s); SIGCONT afterwards in case it was not
  supervisor SIGKILL   kill -9 the supervisor and start a new one at once; its
                       engines should exit by themselves (the lifeline)
  database down 10 s   ALTER DATABASE ... ALLOW_CONNECTIONS false, its sessions
                       terminated, for 10 s
  200 streams          one burst of 200 concurrent streams; every fourth client
                       hangs up after its first token or two
  abuse                one logged-in account on 8 WebSocket chat sockets with
                       n=8 while `--users` others chat: the others' p50 time
                       to first token against theirs alone (bench/abuse.py;
                       its own table, goal <= 1.5x with the default user limits)
  relay_flood          on a two-node cluster of its own (network namespaces, as
                       root), 500 unauthenticated connections held open against
                       node b's relay while a client streams through it: the
                       client's p50 time to first token against the same run
                       without the flood, and whether b's supervisor, engine
                       and heartbeat are alive afterwards (bench/relay_flood.py;
                       its own table, goal <= 1.5x)

Each request ends as exactly one of: succeeded (a finish_reason and `[DONE]`),
429, error (another status, or an error event mid-stream), lost (neither an
answer nor an error: the stream ended without `[DONE]`, the connection closed
before a status, or the client's own timeout passed) or, in the burst, hung up
(by the client, on purpose). Latency: p50/p99 of the succeeded, request to
`[DONE]`. Recovery: from the fault until the first request started after the
last failed one succeeds ("-": nothing failed; "n/r": not within the deadline).

After every scenario the bench waits (bounded) until the engine shows no leases
(queue_depth, slots_in_use, each model's inflight/queued/busy all 0) and the
fleet's RSS (engine + supervisor + front) is back within 10% of the idle figure
measured after the warm-up. Every loop is bounded in count and time; the whole
run takes a few minutes. Exit status non-zero only when the bench itself could
not run; the platform's misbehaviour is reported in the table and its notes.

The faults live in bench/faults.py, the clients and how recovery is measured in
bench/load.py, the table and the JSON dump in bench/reliability_report.py; this
module holds the scenarios and the checks after each.
"""

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import abuse, relay_flood  # noqa: E402
from bench.faults import Database, EngineWatch, FaultPlatform  # noqa: E402
from bench.front import ENGINE, MODEL  # noqa: E402
from bench.generation import MODEL_PATH  # noqa: E402
from bench.load import (  # noqa: E402
    BEFORE_FAULT_S,
    CLIENT_TIMEOUT_S,
    PAUSE_S,
    Load,
    Result,
)
from bench.reliability_report import dump, log_summary, report  # noqa: E402
from engines.wire.client import EngineClient, EngineError  # noqa: E402
from engines.wire.replies import StateReply  # noqa: E402

BURST_TIMEOUT_S = 120.0  # the burst's requests wait in the engine's queue
DB_DOWN_S = 10.0
LEASES_DEADLINE_S = 60.0  # after a scenario: no leases by then is a failure
RSS_DEADLINE_S = 20.0  # then this long more for memory to come back
RSS_TOLERANCE = 0.10
SCENARIOS = (
    "engine_sigkill",
    "engine_sigkill_ws",
    "engine_sigstop",
    "supervisor_sigkill",
    "database_down",
    "burst",
    "abuse",
    "relay_flood",
)


# -- the bench --------------------------------------------------------------------


class Bench:
    def __init__(self, platform: FaultPlatform, database: Database, args) -> None:
        self.platform = platform
        self.database = database
        self.args = args
        self.watch = EngineWatch(platform.run_dir)
        self.load = Load(
            platform.port, platform.key, tokens=args.tokens, clients=args.clients
        )
        self.idle_mib = 0.0
        self.idle_parts = ""
        self.results: list[Result] = []
        self.abuse_phases: list[abuse.Phase] = []

    async def engine_state(self) -> StateReply | None:
        try:
            client = EngineClient.for_engine(self.platform.run_dir, ENGINE)
            return await asyncio.to_thread(client.state)
        except (EngineError, OSError, ValueError):
            return None

    # -- the scenarios ------------------------------------------------------------

    async def engine_sigkill(self, transport: str = "sse") -> Result:
        async def inject(result: Result) -> None:
            pid = self.watch.sample()
            process = self.watch.process(pid)
            if process is None:
                result.notes.append("no engine process to kill")
                return
            process.kill()
            result.notes.append(f"killed engine pid {pid}")

        load = self.load
        if transport == "ws":
            load = Load(
                self.platform.port,
                self.platform.key,
                tokens=self.args.tokens,
                clients=self.args.clients,
                transport="ws",
            )
        result = await load.around_fault(
            f"engine SIGKILL mid-stream ({transport.upper()})",
            inject,
            watch_at_least_s=10,
            deadline_s=60,
        )
        self.note_replacement(result)
        return result

    async def engine_sigkill_ws(self) -> Result:
        return await self.engine_sigkill("ws")

    async def engine_sigstop(self) -> Result:
        stopped: list[psutil.Process] = []

        async def inject(result: Result) -> None:
            pid = self.watch.sample()
            process = self.watch.process(pid)
            if process is None:
                result.notes.append("no engine process to stop")
                return
            process.suspend()
            stopped.append(process)
            result.notes.append(f"stopped engine pid {pid}")

        async def cleanup() -> None:
            for process in stopped:
                if self.watch.process(process.pid):
                    with contextlib.suppress(psutil.Error):
                        process.resume()
                        stopped_left.append(process.pid)

        stopped_left: list[int] = []
        result = await self.load.around_fault(
            "engine SIGSTOP",
            inject,
            watch_at_least_s=30,
            deadline_s=90,
            cleanup=cleanup,
        )
        self.note_replacement(result)
        if stopped_left:
            result.notes.append(
                f"engine pid {stopped_left} still there (stopped) at the end: "
                "sent SIGCONT"
            )
        return result

    async def supervisor_sigkill(self) -> Result:
        old_engines: list[psutil.Process] = []
        exits: dict[int, float] = {}
        fault_at: list[float] = []

        def note_exits() -> None:
            for process in old_engines:
                if process.pid not in exits and not self.watch.process(process.pid):
                    exits[process.pid] = time.monotonic() - fault_at[0]

        async def watch_exits(stop: asyncio.Event) -> None:
            while not stop.is_set():
                if fault_at:
                    note_exits()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)

        async def inject(result: Result) -> None:
            fault_at.append(result.fault_at)
            old_engines.extend(self.watch.alive())
            supervisor = self.platform.supervisor
            supervisor.kill()
            await asyncio.to_thread(supervisor.wait)
            self.platform.restart_supervisor()
            result.notes.append(
                f"killed supervisor pid {supervisor.pid}, started pid "
                f"{self.platform.supervisor.pid}; the old one's engines: "
                f"{[p.pid for p in old_engines]}"
            )

        async def overdue(result: Result) -> float:
            """Not recovered: the dead supervisor's engines, if still there, hold
            the port; kill them (and restart a supervisor that exited), watch on."""
            note_exits()
            more = 0.0
            left = [p for p in old_engines if self.watch.process(p.pid)]
            for process in left:
                process.kill()
            if left:
                more = 90.0
                result.notes.append(
                    f"not recovered {time.monotonic() - result.fault_at:.0f} s "
                    f"after the kill with the old engine(s) {[p.pid for p in left]} "
                    "still running: the bench killed them"
                )
            if self.platform.supervisor.poll() is not None:
                more = 90.0
                result.notes.append(
                    f"the new supervisor exited ({self.platform.supervisor.returncode})"
                    ": the bench started another"
                )
                self.platform.restart_supervisor()
            return more

        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_exits(stop))
        try:
            result = await self.load.around_fault(
                "supervisor SIGKILL + restart",
                inject,
                watch_at_least_s=20,
                deadline_s=90,
                overdue=overdue,
            )
        finally:
            stop.set()
            await watcher
        note_exits()
        for process in old_engines:
            if process.pid in exits:
                result.notes.append(
                    f"old engine pid {process.pid} exited "
                    f"{exits[process.pid]:.1f} s after the supervisor's kill"
                )
            elif self.watch.process(process.pid):
                result.notes.append(
                    f"old engine pid {process.pid} still running at the end: "
                    "no lifeline (the bench kills it at exit)"
                )
        self.note_replacement(result)
        return result

    async def database_down(self) -> Result:
        async def inject(result: Result) -> None:
            await asyncio.to_thread(self.database.take_away)
            end = time.monotonic() + DB_DOWN_S
            while time.monotonic() < end:
                await asyncio.sleep(1)
                await asyncio.to_thread(self.database.terminate)
            await asyncio.to_thread(self.database.give_back)
            result.notes.append(
                f"database refused connections for "
                f"{time.monotonic() - result.fault_at:.1f} s"
            )

        async def cleanup() -> None:
            await asyncio.to_thread(self.database.give_back)

        return await self.load.around_fault(
            f"database down {DB_DOWN_S:g} s",
            inject,
            watch_at_least_s=DB_DOWN_S + 10,
            deadline_s=DB_DOWN_S + 60,
            cleanup=cleanup,
        )

    async def burst(self) -> Result:
        streams = self.args.burst
        result = Result(f"{streams} streams, 1/4 hang up")
        result.outcomes = list(
            await asyncio.gather(
                *(
                    self.load.stream(
                        timeout=BURST_TIMEOUT_S,
                        hang_up_after=(1 + index // 4 % 2) if index % 4 == 0 else 0,
                    )
                    for index in range(streams)
                )
            )
        )
        result.notes.append(
            f"{sum(index % 4 == 0 for index in range(streams))} clients meant to "
            "hang up after 1-2 tokens; those answered 429 first count as 429"
        )
        return result

    def note_replacement(self, result: Result) -> None:
        changes = [(t, pid) for t, pid in self.watch.changes if t > result.fault_at]
        if changes:
            result.notes.append(
                "connection file's engine pid: "
                + ", ".join(
                    f"{pid or 'none'} at +{t - result.fault_at:.1f} s"
                    for t, pid in changes
                )
            )

    # -- after each scenario ------------------------------------------------------

    async def until_idle(self) -> float:
        """Wait (bounded) until the engine shows no leases; seconds waited."""
        began = time.monotonic()
        while time.monotonic() < began + LEASES_DEADLINE_S:
            state = await self.engine_state()
            if state is not None and not leases(state):
                break
            await asyncio.sleep(0.5)
        return time.monotonic() - began

    async def settle(self, result: Result) -> None:
        """Wait for no leases, then for memory near idle; note what was seen."""
        began = time.monotonic()
        state, idle = None, False
        while time.monotonic() < began + LEASES_DEADLINE_S:
            state = await self.engine_state()
            if state is not None and not leases(state):
                idle = True
                break
            await asyncio.sleep(0.5)
        waited = time.monotonic() - began
        if idle:
            result.leases = f"0 in {waited:.1f} s"
        elif state is None:
            result.leases = f"no state {waited:.0f} s"
            result.notes.append("the engine did not answer `state` after the run")
        else:
            result.leases = f"{leases(state)} at {waited:.0f} s"
            result.notes.append(f"engine state after {waited:.0f} s: {leases(state)}")
        if state is None:
            result.rss = "?"
            return
        ratio = 0.0
        end = time.monotonic() + RSS_DEADLINE_S
        while True:
            mib = self.platform.fleet_rss_mib(state.rss_mib)
            ratio = mib / self.idle_mib - 1
            if abs(ratio) <= RSS_TOLERANCE or time.monotonic() >= end:
                break
            await asyncio.sleep(1)
            state = await self.engine_state() or state
        verdict = "ok" if abs(ratio) <= RSS_TOLERANCE else "OVER"
        result.rss = f"{ratio * 100:+.1f}% {verdict}"
        if verdict != "ok":
            result.notes.append(
                f"fleet RSS {mib:.0f} MiB vs idle {self.idle_mib:.0f} MiB "
                f"({self.rss_parts(state)})"
            )

    def rss_parts(self, state: StateReply) -> str:
        parts = [f"engine {state.rss_mib:.0f}"]
        for label, process in (
            ("supervisor", self.platform.supervisor),
            ("front", self.platform.front),
        ):
            try:
                mib = psutil.Process(process.pid).memory_info().rss / 2**20
                parts.append(f"{label} {mib:.0f}")
            except psutil.Error:
                parts.append(f"{label} gone")
        return " + ".join(parts) + " MiB"

    async def warm_up(self) -> None:
        """Load the model, let everything settle, measure the idle fleet."""
        for _ in range(2):
            await asyncio.gather(
                *(
                    self.load.stream(timeout=CLIENT_TIMEOUT_S)
                    for _ in range(self.args.clients)
                )
            )
        deadline = time.monotonic() + LEASES_DEADLINE_S
        state = await self.engine_state()
        while (state is None or leases(state)) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            state = await self.engine_state()
        if state is None:
            raise SystemExit("the engine does not answer `state` after the warm-up")
        await asyncio.sleep(2)
        samples = []
        for _ in range(3):
            state = await self.engine_state() or state
            samples.append(self.platform.fleet_rss_mib(state.rss_mib))
            await asyncio.sleep(1)
        self.idle_mib = statistics.median(samples)
        self.idle_parts = self.rss_parts(state)

    async def run(self) -> None:
        stop = asyncio.Event()
        follower = asyncio.create_task(self.watch.follow(stop))
        try:
            await self.warm_up()
            print(f"idle fleet RSS {self.idle_mib:.0f} MiB ({self.idle_parts})")
            for scenario in (
                self.engine_sigkill,
                self.engine_sigkill_ws,
                self.engine_sigstop,
                self.supervisor_sigkill,
                self.database_down,
                self.burst,
            ):
                if self.args.only and scenario.__name__ not in self.args.only:
                    continue
                began = time.monotonic()
                result = await scenario()
                await self.settle(result)
                self.results.append(result)
                print(
                    f"  {result.name}: {len(result.outcomes)} requests in "
                    f"{time.monotonic() - began:.0f} s",
                    flush=True,
                )
            if not self.args.only or "abuse" in self.args.only:
                self.abuse_phases = await abuse.abuse(self)
        finally:
            stop.set()
            await follower


def leases(state: StateReply) -> str:
    """The engine's leases and queue, "" when there are none."""
    held = []
    if state.queue_depth:
        held.append(f"queue {state.queue_depth}")
    if state.slots_in_use:
        held.append(f"slots {state.slots_in_use}")
    for model in state.models:
        for key in ("inflight", "queued", "busy"):
            if getattr(model, key):
                held.append(f"{model.name} {key} {getattr(model, key)}")
    return ", ".join(held)


def cleanup(bench: Bench | None, platform: FaultPlatform | None) -> None:
    """Resume stopped engines, stop the platform, then kill any engine this
    run's connection files named that is still running (a killed supervisor's)."""
    engines = bench.watch.alive() if bench else []
    for process in engines:
        with contextlib.suppress(psutil.Error):
            process.resume()
    if platform is not None:
        platform.stop()
    if bench:
        bench.watch.sample()
        for process in bench.watch.alive():
            with contextlib.suppress(psutil.Error):
                print(f"killing engine pid {process.pid}, left running")
                process.kill()
                process.wait(10)


def _server_url(admin_url: str) -> str:
    """The PostgreSQL server of an admin connection URL, without its database
    (bench/cluster.py names its own)."""
    return admin_url.rsplit("/", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens")
    parser.add_argument("--clients", type=int, default=4, help="streaming clients")
    parser.add_argument("--burst", type=int, default=200, help="concurrent streams")
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        choices=SCENARIOS,
        help="run only these scenarios",
    )
    parser.add_argument(
        "--users", type=int, default=8, help="abuse: the others chatting"
    )
    parser.add_argument(
        "--abuse-streams", type=int, default=2, help="abuse: streams per socket"
    )
    parser.add_argument(
        "--phase-s", type=float, default=abuse.PHASE_S, help="abuse: phase length"
    )
    parser.add_argument(
        "--postgres",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="an admin connection; the bench creates and drops its own database",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the run dir (logs) and database"
    )
    relay_flood.arguments(parser)
    args = parser.parse_args()
    if args.only == ["relay_flood"]:  # a cluster of its own: no platform here
        relay_flood.run(_server_url(args.postgres), args)
        return
    if not MODEL_PATH.exists():
        raise SystemExit(f"{MODEL_PATH} missing: run `make test` or `make run` first")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    database = Database(args.postgres)
    try:
        database.create()
    except psycopg.Error as error:
        raise SystemExit(f"cannot create a PostgreSQL database: {error}") from None
    run_dir = Path(tempfile.mkdtemp(prefix="roundhouse-reliability-"))
    began = time.monotonic()
    print(
        f"{MODEL} on engine {ENGINE}; {os.cpu_count()} cores "
        f"({len(os.sched_getaffinity(0))} usable), all processes share them; "
        f"PostgreSQL database {database.name}; run dir {run_dir}"
    )
    print(
        f"load: {args.clients} clients streaming one request after another "
        f"({PAUSE_S:g} s apart), SSE chat, max_tokens {args.tokens}, greedy, "
        f"client timeout {CLIENT_TIMEOUT_S:g} s, {BEFORE_FAULT_S:g} s before each "
        f"fault; burst: {args.burst} at once, timeout {BURST_TIMEOUT_S:g} s; "
        "platform defaults (2 slots per model, queue limit 64, queue timeout 60 s)"
    )
    platform = bench = None
    try:
        platform = FaultPlatform(run_dir, database.url)
        platform.startup([])
        print(f"platform up in {time.monotonic() - began:.0f} s", flush=True)
        bench = Bench(platform, database, args)
        asyncio.run(bench.run())
    finally:
        try:
            cleanup(bench, platform)
        finally:
            if not args.keep:
                with contextlib.suppress(psycopg.Error):
                    database.drop()
        print(f"done in {time.monotonic() - began:.0f} s")
        if bench and bench.results:
            report(bench.results)
        if bench and bench.abuse_phases:
            abuse.report(bench.abuse_phases, args)
        log_summary(run_dir)
        if not args.only or "relay_flood" in args.only:
            relay_flood.run(_server_url(args.postgres), args)
        if args.keep:
            if bench and bench.results:
                dump(bench.results, run_dir / "outcomes.json")
            print(
                f"kept: run dir {run_dir} (outcomes.json: every request), "
                f"database {database.name}"
            )
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
