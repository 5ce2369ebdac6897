"""Model files for this node: a model placed on this node's engines whose
files this host lacks is copied from another node that has them, over the
node link (platform/node_link/files.py), before the supervisor loads it.

Membership's heartbeat says what is wanted (`want`); the copies run on the
relay's event loop, one task per model, trying the nodes that hold the model
resident first, then the other serving nodes. A failed copy keeps what it
wrote (the next try resumes) and is tried again after RETRY_S. Progress and
failures go to the node's row with each heartbeat (`report`), shown in the
admin (Fleet -> Nodes)."""

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from node_link.client import LinkPool, Peer
from node_link.files import (
    FILES_STREAM,
    MANIFEST_TIMEOUT_S,
    RANGE_TIMEOUT_S,
    CopyFailed,
    copy_model,
)
from node_link.protocol import LinkRefused, PrivateCa

from engines.wire.errors import ProtocolError

from .loop_errors import LoopErrors

log = logging.getLogger("roundhouse.cluster")

RETRY_S = 30.0
NO_DIGESTS = (
    "waiting for the catalog's SHA-256 of its files (recorded by the model's "
    "inspection, or by a host with the front's database credentials that has "
    "the files)"
)
COPY_ERRORS = (
    CopyFailed,
    LinkRefused,
    OSError,
    TimeoutError,
    asyncio.IncompleteReadError,
    ProtocolError,
)


@dataclass
class _Copy:
    dest: Path
    done: int = 0
    size: int = 0
    source: str = ""
    error: str = ""
    running: bool = False
    retry_at: float = 0.0


class ModelCopies:
    """The copies of one node, started from any thread, run on `loop`."""

    def __init__(
        self,
        *,
        node: str,
        secret: str,
        ca: PrivateCa | None = None,
        plain_tcp: bool = False,
        manifest_timeout_s: float = MANIFEST_TIMEOUT_S,
        range_timeout_s: float = RANGE_TIMEOUT_S,
        errors: LoopErrors | None = None,
    ) -> None:
        self.node = node
        self._errors = errors or LoopErrors()
        # A peer that gives no manifest, or no range, within these is passed
        # over for the next (node_link.files.copy_model).
        self._timeouts = {
            "manifest_timeout_s": manifest_timeout_s,
            "range_timeout_s": range_timeout_s,
        }
        self._secret = secret
        self._ca = ca
        self._plain_tcp = plain_tcp  # LinkPool's: peers without TLS reached
        self._copies: dict[str, _Copy] = {}
        self._lock = threading.Lock()
        self._pool: LinkPool | None = None  # made on the loop, on first use

    def want(
        self,
        wanted: Mapping[str, Path],
        peers: Mapping[str, list[Peer]],
        loop: asyncio.AbstractEventLoop,
        digests: Mapping[str, Mapping[str, str]],
    ) -> None:
        """Copy each wanted model (name -> its path here, which is missing)
        from its peers, best first, checked against the catalog's SHA-256 of
        its files (`digests`: a model without them waits for them); copies no
        longer wanted are forgotten (a running one finishes)."""
        now = time.monotonic()
        with self._lock:
            for model in list(self._copies):
                if model not in wanted and not self._copies[model].running:
                    del self._copies[model]
            for model, dest in wanted.items():
                copy = self._copies.setdefault(model, _Copy(dest=dest))
                if copy.running or now < copy.retry_at:
                    continue
                if not peers.get(model):
                    copy.error = "no serving node to copy it from"
                    continue
                if not digests.get(model):
                    copy.error = NO_DIGESTS
                    continue
                copy.running = True
                asyncio.run_coroutine_threadsafe(
                    self._run(model, copy, peers[model], dict(digests[model])), loop
                )

    def missing(self) -> frozenset[str]:
        """Models whose files are still being copied here (or failed to be)."""
        with self._lock:
            return frozenset(self._copies)

    def report(self) -> dict[str, dict]:
        """For the node's row: each copy's progress, source and last error."""
        with self._lock:
            return {
                model: {
                    "done": copy.done,
                    "size": copy.size,
                    "source": copy.source,
                    "error": copy.error,
                }
                for model, copy in sorted(self._copies.items())
            }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def _run(
        self, model: str, copy: _Copy, peers: list[Peer], digests: dict[str, str]
    ) -> None:
        if self._pool is None:
            self._pool = LinkPool(
                node=self.node,
                secret=self._secret,
                ca=self._ca,
                plain_tcp=self._plain_tcp,
            )
        pool = self._pool
        started = time.monotonic()
        try:
            for peer in peers:

                async def open_stream(data: bytes, peer=peer):
                    return (await pool.link(peer)).open(FILES_STREAM, data)

                def progress(done: int, size: int, copy=copy) -> None:
                    copy.done, copy.size = done, size

                copy.source, copy.error = peer.node, ""
                log.info("copying model %s from node %s", model, peer.node)
                try:
                    await copy_model(
                        open_stream,
                        model,
                        copy.dest,
                        digests=digests,
                        progress=progress,
                        **self._timeouts,
                    )
                except COPY_ERRORS as error:
                    copy.error = f"from {peer.node}: {error or type(error).__name__}"
                    log.warning("copying model %s: %s", model, copy.error)
                    continue
                log.info(
                    "copied model %s from node %s: %.1f MiB in %.1f s",
                    model,
                    peer.node,
                    copy.size / 2**20,
                    time.monotonic() - started,
                )
                with self._lock:
                    self._copies.pop(model, None)
                self._errors.cleared(f"copies of {model}")
                return
            copy.retry_at = time.monotonic() + RETRY_S
        except Exception as error:  # noqa: BLE001 - that copy alone fails
            self._errors.failed(f"copies of {model}", error)
            copy.error = "failed: see the supervisor's log"
            copy.retry_at = time.monotonic() + RETRY_S
        finally:
            copy.running = False
