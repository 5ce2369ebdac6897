"""Entry point of an engine process: `python -m engines.serve --name N --port P`.

Started by `manage.py supervise`, which hands over the token and configuration in
the environment (engines/config.py lists the variables). Exits 0 after a
`shutdown` request or SIGTERM/SIGINT, once requests in flight have finished.
"""

import argparse
import asyncio
import logging
import os
import signal
import sys

from .config import CONFIG_ENV, OFFLINE_ENV, TOKEN_ENV, EngineConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.serve")
    parser.add_argument("--name", help="engine name (overrides the config's)")
    parser.add_argument("--port", type=int, help="loopback port (overrides config)")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        print(
            f"{TOKEN_ENV} is not set: engines are started by `manage.py supervise`",
            file=sys.stderr,
        )
        return 2
    if not os.environ.get(CONFIG_ENV):
        print(f"{CONFIG_ENV} is not set", file=sys.stderr)
        return 2
    config = EngineConfig.from_env()
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

    from .server import EngineServer

    server = EngineServer(config, token)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, server.request_stop)
            except NotImplementedError:  # Windows: default handlers apply
                pass
        await server.run()

    try:
        asyncio.run(serve())
    except OSError as error:
        logging.getLogger("roundhouse.engine").error("cannot serve: %s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
