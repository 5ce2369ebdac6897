"""A cluster whose links run under the operator's private CA: every host given
ROUNDHOUSE_CLUSTER_CA/_CERT/_KEY. Node b joins with no model files: it copies
smol-b's from node a over a mutual-TLS link, and front a's requests for
smol-b reach b's engine over one."""

import os

import pytest

from cluster.models import Node
from tests.certificates import Authority
from tests.cluster import cluster_setup
from tests.cluster.cluster_setup import open_cluster, wait_resident


@pytest.fixture(scope="module")
def ca_cluster(cluster_database, django_db_blocker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ca-cluster")
    authority = Authority(tmp / "ca", "roundhouse test CA")
    certificates = {name: authority.node(name) for name in ("a", "b")}

    def node_env(name: str) -> dict:
        files = certificates[name]
        return {
            "ROUNDHOUSE_CLUSTER_CA": str(files.ca),
            "ROUNDHOUSE_CLUSTER_CERT": str(files.cert),
            "ROUNDHOUSE_CLUSTER_KEY": str(files.key),
        }

    def models() -> None:
        cluster_setup.model_row("smol-b", node_labels=["zone-b"])

    empty = tmp / "b-models"
    empty.mkdir()
    with open_cluster(
        tmp, django_db_blocker, models=models, node_env=node_env
    ) as built:
        with django_db_blocker.unblock():
            built.add_node("a", labels=["zone-a"])
            built.add_node("b", labels=["zone-b"], models_dir=empty)
            wait_resident("smol-b", {"eb"})
        yield built, empty


def test_links_under_a_private_ca_carry_copies_and_requests(ca_cluster, orm):
    built, b_models = ca_cluster
    a, b = built.nodes["a"], built.nodes["b"]
    for node in (a, b):
        assert (
            "relay listening" in node.log() and "mutual TLS, private CA" in node.log()
        )
    assert os.listdir(b_models) == [cluster_setup.SMOL]
    assert "copied model smol-b from node a" in b.log()
    _, headers, _ = cluster_setup.routed(a, "smol-b", built.key)
    assert headers["X-Roundhouse-Node"] == "b"
    assert len(Node.objects.get(name="b").tls_fingerprint) == 64
