"""A real relay on loopback that serves model files (engines/wire/link_files.py)
and knows one calling node by its secret: what the files tests link to."""

from collections.abc import Mapping
from pathlib import Path

from engines.wire.link_files import FILES_STREAM, FileServer
from engines.wire.link_relay import Relay
from tests.engines.conftest import free_port


async def file_relay(
    files: Mapping[str, Path],
    *,
    secret: str,
    tls=None,
    node: str = "b",
    caller: str = "a",
) -> tuple[Relay, int]:
    """Node `node`'s relay serving `files` (model name -> path) to node
    `caller` with `secret`; started, with its port."""

    async def authenticate(name: str, given: str) -> str | None:
        return None if (name, given) == (caller, secret) else "wrong secret"

    async def model_path(name: str) -> Path | None:
        return files.get(name)

    relay = Relay(
        node=node,
        authenticate=authenticate,
        engine_address=lambda name: None,
        files=FileServer(model_path),
    )
    port = free_port()
    await relay.start("127.0.0.1", port, tls=tls)
    return relay, port


def files_opener(pool, peer):
    """What copy_model opens its streams with: a files stream to `peer`."""

    async def open_stream(data: bytes):
        return (await pool.link(peer)).open(FILES_STREAM, data)

    return open_stream
