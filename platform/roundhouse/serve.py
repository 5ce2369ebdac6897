"""Serve the front: `python -m roundhouse.serve [--port N]` (PYTHONPATH=platform:.).

The front is `roundhouse.asgi:application` under uvicorn, with uvloop and
httptools, on loopback unless told otherwise. Channels runs under any ASGI
server; ARCHITECTURE.md names Daphne, which Roundhouse used first. Daphne's
Twisted HTTP layer costs about 1.7 ms more per streamed request before its first
token than uvicorn does (bench/front.py, both measured on the same machine; see
bench/README.md), which alone broke the front's latency budget of 3 ms. Daphne
stays installed for `manage.py runserver`.

The Procfile, bench/front.py and the live API tests all start the front
through this module, so they run the same server with the same settings.
"""

import argparse
import ipaddress
import logging
import logging.config
import os
import socket

import uvicorn
from django.conf import settings

log = logging.getLogger("roundhouse.serve")

# Long streams get this long to finish when the front is stopped; then their
# connections are closed, which cancels their requests in the engines.
GRACEFUL_SHUTDOWN_S = 10


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--host",
        default=settings.ROUNDHOUSE_HOST,
        help="address to listen on (ROUNDHOUSE_HOST; default 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=settings.ROUNDHOUSE_PORT,
        help="port to listen on (ROUNDHOUSE_PORT; default 8000)",
    )
    parser.add_argument(
        "--no-access-log", action="store_true", help="do not log each request"
    )
    args = parser.parse_args(argv)
    logging.config.dictConfig(settings.LOGGING)
    level, message = host_names_message(
        args.host, args.port, allowed=list(settings.ALLOWED_HOSTS)
    )
    log.log(level, message)
    uvicorn.run(
        "roundhouse.asgi:application",
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        ws="websockets-sansio",
        # roundhouse.asgi writes the queued usage rows on the lifespan's
        # shutdown.
        lifespan="on",
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
    )


def host_names_message(host: str, port: int, *, allowed: list[str]) -> tuple[int, str]:
    """What the front says at start of the host names it answers (Django's
    ALLOWED_HOSTS): INFO, or WARNING when it listens beyond loopback but
    answers loopback names only, so every other client would get 400
    DisallowedHost."""
    names = ", ".join(allowed) or "none"
    message = (
        f"front on {host}:{port} answers the host names {names} (ALLOWED_HOSTS); "
        "a request for any other name is refused 400 (DisallowedHost)"
    )
    if _loopback(host) or "*" in allowed or not all(map(_loopback, allowed)):
        return logging.INFO, message
    return logging.WARNING, (
        f"{message}. It listens beyond loopback: set ALLOWED_HOSTS to the names "
        f"and addresses clients use (e.g. ALLOWED_HOSTS={socket.gethostname()},"
        "127.0.0.1,localhost), and CSRF_TRUSTED_ORIGINS=https://NAME behind an "
        "HTTPS proxy"
    )


def _loopback(name: str) -> bool:
    """Whether a listen address or host name is this host's loopback."""
    if name.lower() in ("localhost", ".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    main()
