"""The front's engine clients: read from the connection file, again only when
the supervisor has replaced it."""

import pytest

from api.gateway import Gateway
from engines.wire.client import (
    EngineUnreachable,
    connection_file,
    write_connection_file,
)


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
