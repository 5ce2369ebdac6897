"""ModelCopies (platform/fleet/model_copies.py): the copies a node makes of
the models placed on it, against a real relay on loopback: a peer that cannot
give the files is passed over for the next, a copy no peer gives is reported
with its error and left for the retry."""

import asyncio
import os
from pathlib import Path

import pytest
from node_link.client import Peer
from node_link.files import FileServer, model_digests
from node_link.relay import NodeRelay

from fleet import model_copies
from fleet.model_copies import ModelCopies
from tests.platform.node_link.file_relay import model_paths, pinned_relay
from tests.waiting import await_for

SECRET = "copies-secret"
CATALOG = {"m": {"": "0" * 64}}  # digests of a model no peer has


async def relay_of(
    node: str, files: dict[str, Path] | FileServer, tmp_path: Path
) -> tuple[NodeRelay, Peer]:
    """Node `node`'s relay in pinned TLS, serving `files` to node f."""
    return await pinned_relay(tmp_path, files, secret=SECRET, node=node, caller="f")


@pytest.fixture
def source(tmp_path) -> Path:
    """The files of the one-file model `m`, as the serving peers hold them."""
    path = tmp_path / "m.gguf"
    path.write_bytes(os.urandom(100_000))
    return path


async def test_a_copy_passes_over_a_peer_without_the_files(tmp_path, source):
    empty, empty_peer = await relay_of("a", {}, tmp_path)
    full, full_peer = await relay_of("b", {"m": source}, tmp_path)
    copies = ModelCopies(node="f", secret=SECRET, plain_tcp=True)
    dest = tmp_path / "f-models" / "m.gguf"
    try:
        copies.want(
            {"m": dest},
            {"m": [empty_peer, full_peer]},
            asyncio.get_running_loop(),
            {"m": model_digests(source)},
        )
        assert copies.missing() == {"m"}
        await await_for(lambda: not copies.missing(), what="the copy")
        assert dest.read_bytes() == source.read_bytes()
        assert copies.report() == {}
    finally:
        copies.close()
        await empty.close()
        await full.close()


async def test_a_copy_no_peer_gives_is_reported_and_retried_later(
    tmp_path, monkeypatch
):
    empty, empty_peer = await relay_of("a", {}, tmp_path)
    copies = ModelCopies(node="f", secret=SECRET, plain_tcp=True)
    dest = tmp_path / "f-models" / "m.gguf"
    loop = asyncio.get_running_loop()
    try:
        copies.want({"m": dest}, {"m": [empty_peer]}, loop, CATALOG)
        await await_for(lambda: copies.report()["m"]["error"], what="the failure")
        report = copies.report()["m"]
        assert report["source"] == "a" and "no model 'm'" in report["error"]
        assert copies.missing() == {"m"}  # the supervisor does not load it
        # Not tried again before the retry time (control: then it is).
        attempts = []
        real = model_copies.copy_model
        monkeypatch.setattr(
            model_copies,
            "copy_model",
            lambda *a, **k: attempts.append(1) or real(*a, **k),
        )
        await await_for(lambda: not copies._copies["m"].running, what="the end")
        copies.want({"m": dest}, {"m": [empty_peer]}, loop, CATALOG)
        assert attempts == []
        copies._copies["m"].retry_at = 0
        copies.want({"m": dest}, {"m": [empty_peer]}, loop, CATALOG)
        await await_for(lambda: attempts == [1], what="the retry")
        # A model no longer placed here is forgotten.
        await await_for(lambda: not copies._copies["m"].running, what="the end")
        copies.want({}, {}, loop, {})
        assert copies.missing() == frozenset() and copies.report() == {}
    finally:
        copies.close()
        await empty.close()


async def test_no_serving_peer_is_an_error_not_a_copy(tmp_path):
    copies = ModelCopies(node="f", secret=SECRET, plain_tcp=True)
    copies.want({"m": tmp_path / "m"}, {"m": []}, asyncio.get_running_loop(), CATALOG)
    assert copies.report()["m"]["error"] == "no serving node to copy it from"
    assert copies.missing() == {"m"}


class StallingFiles(FileServer):
    """A peer whose link answers pings but whose files streams never answer
    (`stall`: the manifest, or every range after a real manifest)."""

    def __init__(self, source: Path, stall: str) -> None:
        super().__init__(model_paths({"m": source}))
        self._stall = stall
        self.asked = asyncio.Event()

    async def answer(self, payload: bytes) -> bytes:
        if self._stall in payload.decode():
            self.asked.set()
            await asyncio.Event().wait()  # never
        return await super().answer(payload)


@pytest.mark.parametrize("stall", ["manifest", "range"])
async def test_a_peer_that_never_answers_the_stream_is_passed_over(
    tmp_path, source, stall
):
    """A peer that answers the link's pings but never its files stream (the
    manifest, or a range) is given up after the deadline, the next peer is
    tried, and the copy ends (control: without deadlines the copy waits on
    the first peer for ever, `running` stays true)."""
    files = StallingFiles(source, stall)
    stalling, stalling_peer = await relay_of("s", files, tmp_path)
    full, full_peer = await relay_of("b", {"m": source}, tmp_path)
    copies = ModelCopies(
        node="f",
        secret=SECRET,
        plain_tcp=True,
        manifest_timeout_s=0.5,
        range_timeout_s=0.5,
    )
    dest = tmp_path / "f-models" / "m.gguf"
    try:
        copies.want(
            {"m": dest},
            {"m": [stalling_peer, full_peer]},
            asyncio.get_running_loop(),
            {"m": model_digests(source)},
        )
        await files.asked.wait()
        await await_for(lambda: not copies.missing(), what="the copy from b")
        assert dest.read_bytes() == source.read_bytes()
        assert copies._copies == {}  # done: nothing running
    finally:
        copies.close()
        await stalling.close()
        await full.close()


async def test_a_model_without_the_catalogs_digests_is_not_copied(tmp_path, source):
    """A model whose digests the catalog does not know yet waits for them,
    with that said (control: with them, the copy runs: the first test)."""
    full, full_peer = await relay_of("b", {"m": source}, tmp_path)
    copies = ModelCopies(node="f", secret=SECRET, plain_tcp=True)
    try:
        copies.want(
            {"m": tmp_path / "f" / "m.gguf"},
            {"m": [full_peer]},
            asyncio.get_running_loop(),
            {"m": {}},
        )
        assert copies.report()["m"]["error"] == model_copies.NO_DIGESTS
        assert not copies._copies["m"].running
    finally:
        copies.close()
        await full.close()


async def test_a_copy_whose_only_peer_never_answers_ends_with_its_error(
    tmp_path, source
):
    """With no other peer, the copy ends after the manifest's deadline,
    says why and waits for its retry (control: the test above, where the
    next peer then gives the files)."""
    stalling, peer = await relay_of("s", StallingFiles(source, "manifest"), tmp_path)
    copies = ModelCopies(
        node="f", secret=SECRET, plain_tcp=True, manifest_timeout_s=0.2
    )
    try:
        copies.want(
            {"m": tmp_path / "f" / "m.gguf"},
            {"m": [peer]},
            asyncio.get_running_loop(),
            {"m": model_digests(source)},
        )
        await await_for(lambda: not copies._copies["m"].running, what="the copy's end")
        assert "no manifest within 0.2 s" in copies.report()["m"]["error"]
        assert copies.missing() == {"m"}
    finally:
        copies.close()
        await stalling.close()
