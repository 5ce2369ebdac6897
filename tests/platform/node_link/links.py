"""A node link to a real engine, as the link tests open it: a relay on loopback
in the test's event loop and the client of a calling node over it."""

import contextlib

from node_link.client import LinkPool, Peer, RemoteEngineClient
from node_link.relay import NodeRelay

from tests.engines.conftest import free_port

SECRET = "link-test-secret"


@contextlib.asynccontextmanager
async def relay_for(
    engine,
    *,
    tls=None,
    checked: list[str] | None = None,
    serving=lambda: None,
    database=lambda: True,
    lookup=None,
):
    """A relay of node "b" that knows node "a" by SECRET and engine "e1";
    `checked` collects the nodes of the hellos it looked up; `serving` and
    `database` are the node's (why it takes no streams now, whether it
    reaches the cluster's database); `lookup`, awaited with each hello's node
    and secret before it is checked, stands in for the database's time (or
    its errors)."""

    async def authenticate(node: str, secret: str) -> str | None:
        if checked is not None:
            checked.append(node)
        if lookup is not None:
            await lookup(node, secret)
        return None if (node, secret) == ("a", SECRET) else "wrong secret"

    relay = NodeRelay(
        node="b",
        authenticate=authenticate,
        engine_address=lambda name: (
            (engine.port, engine.token) if name == "e1" else None
        ),
        serving=serving,
        database=database,
    )
    port = free_port()
    await relay.start("127.0.0.1", port, tls=tls)
    try:
        yield relay, port
    finally:
        await relay.close()


def remote(port: int, *, secret: str = SECRET, engine: str = "e1", pinned=""):
    pool = LinkPool(node="a", secret=secret, plain_tcp=True)
    peer = Peer(node="b", host="127.0.0.1", port=port, tls_fingerprint=pinned)
    return RemoteEngineClient(name=engine, pool=pool, peer=peer), pool


GREEDY = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 12,
    "temperature": 0,
}
