"""A real relay on loopback that serves model files (platform/node_link/files.py)
and knows one calling node by its secret: what the files tests link to, in
pinned TLS as between nodes (`pinned_relay`) or as the test sets it up."""

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from node_link.client import Peer
from node_link.files import FILES_STREAM, FileServer
from node_link.relay import NodeRelay

from cluster.tls import relay_certificate, server_tls_context
from tests.engines.conftest import free_port


def model_paths(files: Mapping[str, Path]) -> Callable[[str], Awaitable[Path | None]]:
    """A FileServer's lookup of a model's files in `files` (name -> path)."""

    async def model_path(name: str) -> Path | None:
        return files.get(name)

    return model_path


async def file_relay(
    files: Mapping[str, Path] | FileServer,
    *,
    secret: str,
    tls=None,
    node: str = "b",
    caller: str = "a",
) -> tuple[NodeRelay, int]:
    """Node `node`'s relay serving `files` (model name -> path, or a
    FileServer of the test's own) to node `caller` with `secret`; started,
    with its port."""

    async def authenticate(name: str, given: str) -> str | None:
        return None if (name, given) == (caller, secret) else "wrong secret"

    if not isinstance(files, FileServer):
        files = FileServer(model_paths(files))
    relay = NodeRelay(
        node=node,
        authenticate=authenticate,
        engine_address=lambda name: None,
        files=files,
    )
    port = free_port()
    await relay.start("127.0.0.1", port, tls=tls)
    return relay, port


async def pinned_relay(
    folder: Path,
    files: Mapping[str, Path] | FileServer,
    *,
    secret: str,
    node: str = "b",
    caller: str = "a",
) -> tuple[NodeRelay, Peer]:
    """`file_relay` in TLS with a certificate of its own (made under
    `folder`/`node`), as a node's relay is; started, with the Peer that
    reaches it, its certificate's fingerprint pinned."""
    key, cert, fingerprint = relay_certificate(folder / node, node)
    relay, port = await file_relay(
        files,
        secret=secret,
        tls=server_tls_context(key, cert),
        node=node,
        caller=caller,
    )
    peer = Peer(node=node, host="127.0.0.1", port=port, tls_fingerprint=fingerprint)
    return relay, peer


def files_opener(pool, peer):
    """What copy_model opens its streams with: a files stream to `peer`."""

    async def open_stream(data: bytes):
        return (await pool.link(peer)).open(FILES_STREAM, data)

    return open_stream
