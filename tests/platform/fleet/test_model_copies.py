"""ModelCopies (platform/fleet/model_copies.py): the copies a node makes of
the models placed on it, against a real relay on loopback: a peer that cannot
give the files is passed over for the next, a copy no peer gives is reported
with its error and left for the retry."""

import asyncio
import os

from cluster.tls import relay_certificate, server_tls_context
from engines.wire.link_client import Peer
from engines.wire.link_relay import Relay
from fleet import model_copies
from fleet.model_copies import ModelCopies
from tests.engines.file_relay import file_relay
from tests.waiting import await_for

SECRET = "copies-secret"


async def relay_of(node: str, files: dict, tmp_path) -> tuple[Relay, Peer]:
    key, cert, fingerprint = relay_certificate(tmp_path / node, node)
    relay, port = await file_relay(
        files,
        secret=SECRET,
        tls=server_tls_context(key, cert),
        node=node,
        caller="f",
    )
    return relay, Peer(
        node=node, host="127.0.0.1", port=port, tls_fingerprint=fingerprint
    )


async def test_a_copy_passes_over_a_peer_without_the_files(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(os.urandom(100_000))
    empty, empty_peer = await relay_of("a", {}, tmp_path)
    full, full_peer = await relay_of("b", {"m": source}, tmp_path)
    copies = ModelCopies(node="f", secret=SECRET)
    dest = tmp_path / "f-models" / "m.gguf"
    try:
        copies.want(
            {"m": dest}, {"m": [empty_peer, full_peer]}, asyncio.get_running_loop()
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
    copies = ModelCopies(node="f", secret=SECRET)
    dest = tmp_path / "f-models" / "m.gguf"
    loop = asyncio.get_running_loop()
    try:
        copies.want({"m": dest}, {"m": [empty_peer]}, loop)
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
        copies.want({"m": dest}, {"m": [empty_peer]}, loop)
        assert attempts == []
        copies._copies["m"].retry_at = 0
        copies.want({"m": dest}, {"m": [empty_peer]}, loop)
        await await_for(lambda: attempts == [1], what="the retry")
        # A model no longer placed here is forgotten.
        await await_for(lambda: not copies._copies["m"].running, what="the end")
        copies.want({}, {}, loop)
        assert copies.missing() == frozenset() and copies.report() == {}
    finally:
        copies.close()
        await empty.close()


async def test_no_serving_peer_is_an_error_not_a_copy(tmp_path):
    copies = ModelCopies(node="f", secret=SECRET)
    copies.want({"m": tmp_path / "m"}, {"m": []}, asyncio.get_running_loop())
    assert copies.report()["m"]["error"] == "no serving node to copy it from"
    assert copies.missing() == {"m"}
