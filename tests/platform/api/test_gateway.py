"""The front's engine clients: read from the connection file, again only when
the supervisor has replaced it; and its node identity, read again when the
supervisor joined anew."""

import pytest

from api.gateway import Gateway
from cluster.identity import NodeIdentity, identity_write
from engines.wire.client import (
    EngineError,
    EngineUnreachable,
    connection_file,
    write_connection_file,
)
from engines.wire.link_relay import Relay
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
    gateway = Gateway()
    gateway.IDENTITY_RECHECK_S = 0.0
    assert gateway.identity is None
    identity_write(tmp_path, NodeIdentity(name="a", secret="rhn-old"))

    async def authenticate(node, secret):
        return None if (node, secret) == ("a", "rhn-new") else "wrong secret"

    relay = Relay(node="b", authenticate=authenticate, engine_address=lambda _: None)
    port = free_port()
    await relay.start("127.0.0.1", port)
    snapshot = Snapshot(
        engines={"e-b": EngineStatus("e-b", "cpu", frozenset(), True, node="b")},
        models={},
        nodes={"b": NodeRoute("b", "ready", host="127.0.0.1", relay_port=port)},
    )
    try:
        with pytest.raises(EngineUnreachable, match="wrong secret"):
            await gateway.client("e-b", snapshot).ping()
        identity_write(tmp_path, NodeIdentity(name="a", secret="rhn-new"))
        assert gateway.identity == NodeIdentity(name="a", secret="rhn-new")
        # Let in now; the relay has no such engine, and says so in the stream.
        with pytest.raises(EngineError, match="no engine 'e-b' on node b"):
            await gateway.client("e-b", snapshot).ping()
        assert relay.links_of("a") == 1
    finally:
        await relay.close()
