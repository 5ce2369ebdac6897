"""Links under an operator's private CA: mutual TLS, both ends checked
against the CA and the node name their certificate carries. A real relay on
loopback and the real link pool; certificates made by the test."""

import contextlib
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from node_link.client import LinkPool, Peer
from node_link.files import copy_model
from node_link.protocol import LinkRefused, PrivateCa

from cluster.tls import certificate_file_fingerprint, private_ca, server_tls_context
from tests.certificates import Authority
from tests.platform.node_link.file_relay import file_relay, files_opener

SECRET = "ca-test-secret"


@pytest.fixture
def ca(tmp_path):
    return Authority(tmp_path / "ca", "roundhouse test CA")


WEIGHTS = b"weights" * 1000
CATALOG = {"": hashlib.sha256(WEIGHTS).hexdigest()}  # the catalog's digest


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(WEIGHTS)
    return path


@contextlib.asynccontextmanager
async def relay_b(served: PrivateCa, *, clients_of: Path, model: Path):
    """Node b's relay in mutual TLS: its certificate `served`, callers'
    checked against the CA at `clients_of`; it knows node a by SECRET."""
    tls = server_tls_context(served.key, served.cert, client_ca=clients_of)
    relay, port = await file_relay({"m": model}, secret=SECRET, tls=tls)
    try:
        # Pinned too, rightly: a caller without the CA would accept the relay.
        pinned = certificate_file_fingerprint(served.cert)
        yield Peer(node="b", host="127.0.0.1", port=port, tls_fingerprint=pinned)
    finally:
        await relay.close()


async def copy_over(pool: LinkPool, peer: Peer, dest: Path) -> None:
    try:
        await copy_model(
            files_opener(pool, peer),
            "m",
            dest,
            digests=CATALOG,
            progress=lambda *p: None,
        )
    finally:
        pool.close()


async def test_nodes_of_one_ca_link_in_mutual_tls(ca, model, tmp_path):
    """Both certificates from the CA, each naming its node (one as a DNS
    name, one as its common name): the link is made and carries a copy."""
    async with relay_b(ca.node("b"), clients_of=ca.path, model=model) as peer:
        pool = LinkPool(node="a", secret=SECRET, ca=ca.node("a", as_common_name=True))
        await copy_over(pool, peer, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == model.read_bytes()


async def test_a_caller_without_a_certificate_of_the_ca_is_refused(ca, model, tmp_path):
    """No certificate (a pool in pinned mode), or one another CA signed: the
    relay's TLS refuses the link, whatever secret it would have sent."""
    rogue = Authority(tmp_path / "rogue", "another CA")
    async with relay_b(ca.node("b"), clients_of=ca.path, model=model) as peer:
        for pool in (
            LinkPool(node="a", secret=SECRET, plain_tcp=True),
            LinkPool(node="a", secret=SECRET, ca=replace(rogue.node("a"), ca=ca.path)),
        ):
            with pytest.raises((OSError, LinkRefused)) as refused:
                await copy_over(pool, peer, tmp_path / "copy")
            assert "wrong secret" not in str(refused.value)
    assert not (tmp_path / "copy").exists()


async def test_a_relay_without_a_certificate_of_the_ca_is_refused(ca, model, tmp_path):
    """A relay whose certificate another CA signed is refused before the
    caller sends its secret."""
    rogue = Authority(tmp_path / "rogue", "another CA")
    async with relay_b(rogue.node("b"), clients_of=ca.path, model=model) as peer:
        pool = LinkPool(node="a", secret=SECRET, ca=ca.node("a"))
        with pytest.raises(LinkRefused, match="not signed by the cluster's CA"):
            await copy_over(pool, peer, tmp_path / "copy")


async def test_certificates_must_name_the_node(ca, model, tmp_path):
    """The CA's certificate for node c does not pass for node b's relay, nor
    for a caller whose hello says it is node a (with a's secret)."""
    async with relay_b(ca.node("c"), clients_of=ca.path, model=model) as peer:
        pool = LinkPool(node="a", secret=SECRET, ca=ca.node("a"))
        with pytest.raises(LinkRefused, match="is for c, x, not this node"):
            await copy_over(pool, peer, tmp_path / "copy")
    async with relay_b(ca.node("b"), clients_of=ca.path, model=model) as peer:
        pool = LinkPool(node="a", secret=SECRET, ca=ca.node("c"))
        # Refused as every refusal is (the relay's log says why).
        with pytest.raises(LinkRefused, match="link refused"):
            await copy_over(pool, peer, tmp_path / "copy")


def test_the_settings_name_all_three_files_or_none(ca, settings, tmp_path):
    node = ca.node("a")
    settings.ROUNDHOUSE_CLUSTER_CA = ""
    settings.ROUNDHOUSE_CLUSTER_CERT = ""
    settings.ROUNDHOUSE_CLUSTER_KEY = ""
    assert private_ca() is None
    settings.ROUNDHOUSE_CLUSTER_CA = str(node.ca)
    with pytest.raises(ImproperlyConfigured, match="ROUNDHOUSE_CLUSTER_CERT"):
        private_ca()
    settings.ROUNDHOUSE_CLUSTER_CERT = str(node.cert)
    settings.ROUNDHOUSE_CLUSTER_KEY = str(tmp_path / "missing.key")
    with pytest.raises(ImproperlyConfigured, match="no file at"):
        private_ca()
    settings.ROUNDHOUSE_CLUSTER_KEY = str(node.key)
    assert private_ca() == node
