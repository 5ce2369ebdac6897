"""Entry point of an engine process:
`python -m engines.runtime.serve --name N --port P`.

Started by `manage.py supervise`, which hands over the token and configuration in
the environment (engines/launch/environment.py lists the variables). Exits 0 after a
`shutdown` request or SIGTERM/SIGINT, once requests in flight have finished.

An engine never outlives its supervisor: it watches a lifeline pipe whose write
end only the supervisor holds, and stops as on SIGTERM when the pipe reads
end-of-file, which the kernel delivers however the supervisor died (SIGKILL
included). A pipe rather than PR_SET_PDEATHSIG, which fires when the *thread*
that spawned the engine ends, not the process. Stopping is bounded: the drain
may take the server's drain timeout plus time to flush answers; past that the
process exits anyway, and a second SIGTERM or SIGINT exits at once.
"""

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from engines.launch.config import EngineConfig
from engines.launch.environment import (
    CONFIG_ENV,
    TOKEN_ENV,
    config_in_environment,
    lifeline_fd_from_environment,
    offline_environment_set,
    token_from_environment,
)

log = logging.getLogger("roundhouse.engine")

# After a stop request, the server drains for up to its drain timeout and then
# waits up to 10 s for answers to flush; this leaves 5 s more for the rest.
STOP_GRACE_S = 15.0
EXIT_STUCK = 70  # the drain overran the deadline


class Stopper:
    """Ends the process within a bound once asked: the first request starts the
    server's normal stop (drain), a deadline thread exits the process if that
    overruns, and a second signal exits at once. Thread- and signal-safe."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.requested = ""
        self._signals = 0
        self._on_stop: Callable[[], None] | None = None
        # Reentrant: a signal handler runs on the main thread, maybe inside attach.
        self._lock = threading.RLock()

    def attach(self, on_stop: Callable[[], None]) -> None:
        """Call `on_stop` (thread-safe) on the first request, or now if one came."""
        with self._lock:
            self._on_stop = on_stop
            requested = self.requested
        if requested:
            on_stop()

    def request(self, why: str) -> None:
        with self._lock:
            first = not self.requested
            self.requested = self.requested or why
            on_stop = self._on_stop
        if not first:
            return
        log.info("stopping (%s): exiting within %.0f s", why, self.deadline_s)
        threading.Thread(target=self._deadline, name="deadline", daemon=True).start()
        # The kernel's own backstop, should no Python thread get to run: SIGALRM
        # is left at its default action, which ends the process.
        signal.alarm(int(self.deadline_s) + 5)
        if on_stop is not None:
            on_stop()

    def on_signal(self, signum: int, _frame=None) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals > 1:
            log.warning("%s again: exiting now", name)
            os._exit(128 + signum)
        self.request(name)

    def _deadline(self) -> None:
        threading.Event().wait(self.deadline_s)
        log.error(
            "still running %.0f s after the stop request: exiting", self.deadline_s
        )
        logging.shutdown()
        os._exit(EXIT_STUCK)


def watch_lifeline(fd: int, stopper: Stopper) -> None:
    """Stop when the supervisor's end of the pipe closes (it died)."""

    def wait() -> None:
        while True:
            try:
                if not os.read(fd, 64):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        stopper.request("the supervisor is gone")

    os.set_inheritable(fd, False)  # the engine's own children must not hold it
    threading.Thread(target=wait, name="lifeline", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.runtime.serve")
    parser.add_argument("--name", help="engine name (overrides the config's)")
    parser.add_argument("--port", type=int, help="loopback port (overrides config)")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    offline_environment_set()
    token = token_from_environment()
    if not token:
        print(
            f"{TOKEN_ENV} is not set: engines are started by `manage.py supervise`",
            file=sys.stderr,
        )
        return 2
    if not config_in_environment():
        print(f"{CONFIG_ENV} is not set", file=sys.stderr)
        return 2
    try:
        config = EngineConfig.from_env()
    except (OSError, ValueError) as error:
        print(f"bad engine configuration: {error}", file=sys.stderr)
        return 2
    if args.name:
        config.name = args.name
    if args.port is not None:
        config.port = args.port
    if config.cpus:
        # Before any thread starts: threads inherit the affinity they start with.
        try:
            os.sched_setaffinity(0, config.cpus)
        except (AttributeError, OSError, ValueError) as error:
            print(
                f"cannot run on CPU cores {config.cpus}: {error}",
                file=sys.stderr,
            )
            return 2

    from engines.runtime.server import DRAIN_TIMEOUT_S, EngineServer

    stopper = Stopper(DRAIN_TIMEOUT_S + STOP_GRACE_S)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopper.on_signal)
    lifeline = lifeline_fd_from_environment()
    if lifeline is not None:
        watch_lifeline(lifeline, stopper)

    server = EngineServer(config, token)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stopper.attach(lambda: loop.call_soon_threadsafe(server.request_stop))
        await server.run()

    try:
        asyncio.run(serve())
    except OSError as error:
        log.error("cannot serve: %s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
