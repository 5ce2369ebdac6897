"""A relay in a process of its own allowed few open files, as issue 31
reproduced a supervisor's death (RLIMIT_NOFILE 256, 300 idle connections):
a real NodeRelay of node "b" (node "a" known by its secret, engine "e1" at
its port with its token: a JSON line on stdin, {"secret", "port", "token"}),
and a stand-in for the supervisor's other loops in the same process: a
heartbeat thread that opens a socket and a file every BEAT_S, as a
heartbeat's database reconnect and a read of an engine's connection file do.

Run: python -m tests.platform.node_link.relay_child PORT [--no-caps]
(PYTHONPATH=platform:.). It prints "listening" once the relay listens, then
one line per beat: "beat N ok" or "beat N failed: ERROR". `--no-caps` lifts
the admission's caps and the handshake bound (a test's control: the relay
as it was before issue 31)."""

import asyncio
import json
import resource
import socket
import sys
import threading

from node_link import relay as link_relay
from node_link.admission import Handshakes
from node_link.relay import NodeRelay

OPEN_FILES = 256
BEAT_S = 0.1


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def heartbeat() -> None:
    """Open and close a socket and a file every BEAT_S, saying how it went."""
    beat = 0
    while True:
        beat += 1
        try:
            with socket.socket(), open(__file__, "rb"):
                pass
        except OSError as error:
            say(f"beat {beat} failed: {error}")
        else:
            say(f"beat {beat} ok")
        threading.Event().wait(BEAT_S)


async def main(port: int, caps: bool) -> None:
    given = json.loads(sys.stdin.readline())
    secret, engine_port, token = given["secret"], given["port"], given["token"]

    async def authenticate(node: str, given: str) -> str | None:
        return None if (node, given) == ("a", secret) else "wrong secret"

    relay = NodeRelay(
        node="b",
        authenticate=authenticate,
        engine_address=lambda name: (int(engine_port), token) if name == "e1" else None,
    )
    if not caps:
        link_relay.HANDSHAKE_S = 600
        relay.handshakes = Handshakes(total=10**6, per_address=10**6)
    await relay.start("127.0.0.1", port)
    say("listening")
    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, hard))
    asyncio.run(main(int(sys.argv[1]), caps="--no-caps" not in sys.argv[2:]))
