"""The front's engine clients: read from the connection file, again only when
the supervisor has replaced it; and its node identity, read again when the
supervisor joined anew."""

import pytest
from node_link.relay import NodeRelay

from api.gateway import Gateway
from cluster.identity import NodeIdentity, identity_write
from engines.wire.client import (
    EngineError,
    EngineUnreachable,
    connection_file,
    write_connection_file,
)
from routing.placement import NodeRoute
from routing.select import EngineStatus, Snapshot
from tests.engines.conftest import free_port


def test_a_client_is_read_again_only_when_its_file_changes(settings, tmp_path):
    settings.RUN_DIR = tmp_path
    gateway = Gateway()
    write_connection_file(tmp_path, name="e0", port=41001, token="first")
    client = gateway.client("e0")
    assert client.port == 41001
    assert gateway.client("e0") is client  # unchanged file: the same client
    # The engine restarted: the supervisor wrote a new port and token.
    write_connection_file(tmp_path, name="e0", port=41002, token="second")
    restarted = gateway.client("e0")
    assert restarted is not client
    assert (restarted.port, restarted._token) == (41002, "second")
    # The engine is gone with its file: unreachable, as without the cache.
    connection_file(tmp_path, "e0").unlink()
    with pytest.raises(EngineUnreachable, match="no connection file"):
        gateway.client("e0")


async def test_a_new_node_identity_is_taken_without_a_restart(settings, tmp_path):
    """The node was revoked and added again: its supervisor joined anew and
    wrote a new identity. The front takes it at its next look, without a
    restart, and its links then speak with the new secret: a relay that knows
    only the new one refused the old (control) and takes the new."""
    settings.RUN_DIR = tmp_path
    settings.ROUNDHOUSE_CLUSTER_TLS = False  # the relay below is plain TCP
    gateway = Gateway()
    gateway.IDENTITY_RECHECK_S = 0.0
    assert gateway.identity is None
    identity_write(tmp_path, NodeIdentity(name="a", secret="rhn-old"))

    async def authenticate(node, secret):
        return None if (node, secret) == ("a", "rhn-new") else "wrong secret"

    relay = NodeRelay(
        node="b", authenticate=authenticate, engine_address=lambda _: None
    )
    port = free_port()
    await relay.start("127.0.0.1", port)
    snapshot = Snapshot(
        engines={"e-b": EngineStatus("e-b", "cpu", frozenset(), True, node="b")},
        models={},
        nodes={"b": NodeRoute("b", "ready", host="127.0.0.1", relay_port=port)},
    )
    try:
        with pytest.raises(EngineUnreachable, match="link refused"):
            await gateway.client("e-b", snapshot).ping()
        identity_write(tmp_path, NodeIdentity(name="a", secret="rhn-new"))
        assert gateway.identity == NodeIdentity(name="a", secret="rhn-new")
        # Let in now; the relay has no such engine, and says so in the stream.
        with pytest.raises(EngineError, match="no engine 'e-b' on node b"):
            await gateway.client("e-b", snapshot).ping()
        assert relay.links_of("a") == 1
    finally:
        await relay.close()


async def test_a_node_no_link_reaches_is_passed_over_at_once(
    settings, tmp_path, own_gateway
):
    """A model with a replica on node c (first in order: nothing listens at its
    relay's address) and one on node b. The first request tries c, fails to
    link, and is served by b; the next goes to b at once, without trying c
    (control: it tried c first again). A model only c holds is still tried
    there, and answers why it failed."""
    from api import pipeline
    from api.calls import Call
    from api.errors import ApiError
    from routing.select import ModelRoute

    settings.RUN_DIR = tmp_path
    settings.ROUNDHOUSE_CLUSTER_TLS = False  # a plain link: refused by c's port
    identity_write(tmp_path, NodeIdentity(name="a", secret="rhn-a"))
    own_gateway()  # this test's: no node passed over yet
    route = ModelRoute(name="m", format="gguf", task="chat", replicas=2)
    lonely = ModelRoute(name="only-c", format="hf", task="chat")  # b: no hf
    engines = {
        name: EngineStatus(
            name,
            "cpu",
            formats,
            True,
            order=order,
            resident=models,
            node=node,
        )
        for name, node, order, formats, models in (
            ("e-c", "c", 0, frozenset({"gguf", "hf"}), frozenset({"m", "only-c"})),
            ("e-b", "b", 1, frozenset({"gguf"}), frozenset({"m"})),
        )
    }
    nodes = {
        name: NodeRoute(name, "ready", host="127.0.0.1", relay_port=free_port())
        for name in ("b", "c")
    }
    snapshot = Snapshot(
        engines=engines, models={"m": route, "only-c": lonely}, nodes=nodes
    )
    tried: list[str] = []

    async def attempt(client):
        tried.append(client.name)
        if client.name == "e-b":
            return "answered by b"  # b's relay is not what this test is about
        return await client.ping()  # c: no relay listens there

    assert await pipeline.with_engine(
        Call("chat", route=route, snapshot=snapshot), attempt
    ) == ("answered by b")
    assert tried == ["e-c", "e-b"]
    tried.clear()
    assert await pipeline.with_engine(
        Call("chat", route=route, snapshot=snapshot), attempt
    ) == ("answered by b")
    assert tried == ["e-b"]  # c passed over at once
    tried.clear()
    with pytest.raises(ApiError) as failed:
        await pipeline.with_engine(
            Call("chat", route=lonely, snapshot=snapshot), attempt
        )
    assert tried == ["e-c"]
    assert "node c" in str(failed.value.message)
