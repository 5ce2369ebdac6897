"""Nodes in the admin and their services: the join command shown once, the
join token used once, the node's own secret, heartbeats by the database's
clock, drain and revoke; and a one-host platform (SQLite) that says it stays
one node."""

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.contrib.messages import get_messages
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from cluster.identity import identity_read, identity_write, secret_hash
from cluster.models import UNREACHABLE_AFTER_S, Node, NodeStatus
from cluster.selectors import nodes_now
from cluster.services import (
    ClusterUnavailable,
    NodeRefused,
    node_authenticate,
    node_create,
    node_heartbeat,
    node_join,
    node_revoke,
)
from tests.conftest import ROOT
from tests.platform.live import database_url

pytestmark = pytest.mark.django_db

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="joining needs PostgreSQL"
)


@postgres_only
def test_a_join_token_works_once_and_only_its_hash_is_kept():
    node, token = node_create(name="gpu-1", address="10.0.0.5")
    assert node.join_token_hash == secret_hash(token) and token not in str(
        Node.objects.values().get()
    )
    identity = node_join(name="gpu-1", join_token=token)
    node.refresh_from_db()
    assert node.secret_hash == secret_hash(identity.secret)
    assert node.join_token_hash == "" and node.joined_at is not None
    with pytest.raises(NodeRefused, match="was used already"):
        node_join(name="gpu-1", join_token=token)
    with pytest.raises(NodeRefused, match="no node named 'gpu-9'"):
        node_join(name="gpu-9", join_token=token)
    assert node_authenticate(name="gpu-1", secret=identity.secret) == node
    with pytest.raises(NodeRefused, match="wrong secret"):
        node_authenticate(name="gpu-1", secret="rhn-guess")


@postgres_only
def test_an_expired_join_token_is_refused():
    node, token = node_create(name="late", address="10.0.0.6")
    Node.objects.filter(pk=node.pk).update(
        join_token_expires_at=timezone.now() - timedelta(seconds=1)
    )
    with pytest.raises(NodeRefused, match="expired"):
        node_join(name="late", join_token=token)


@postgres_only
def test_a_join_token_expires_by_the_databases_clock(monkeypatch):
    """A token issued on a host whose clock runs an hour behind, and used on
    one whose clock runs an hour ahead, still joins within its time: both
    ends use the database's clock. Control: the same token past its expiry by
    that clock is refused."""
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(hours=1))
    node, token = node_create(name="skewed", address="10.0.0.9")
    assert node.join_token_expires_at > real_now()
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(hours=1))
    node_join(name="skewed", join_token=token)

    node, token = node_create(name="skewed-late", address="10.0.0.10")
    Node.objects.filter(pk=node.pk).update(
        join_token_expires_at=real_now() - timedelta(seconds=1)
    )
    with pytest.raises(NodeRefused, match="expired"):
        node_join(name="skewed-late", join_token=token)


@postgres_only
def test_a_revoked_node_cannot_join_beat_or_prove_itself():
    node, token = node_create(name="gone", address="10.0.0.7")
    identity = node_join(name="gone", join_token=token)
    node_heartbeat(identity=identity)
    node_revoke(node=node)
    for attempt in (
        lambda: node_heartbeat(identity=identity),
        lambda: node_authenticate(name="gone", secret=identity.secret),
        lambda: node_join(name="gone", join_token=token),
    ):
        with pytest.raises(NodeRefused, match="revoked"):
            attempt()
    assert nodes_now()["gone"].status == NodeStatus.REVOKED


@postgres_only
def test_status_follows_the_heartbeat_by_the_databases_clock():
    """Ready while it beats; unreachable UNREACHABLE_AFTER_S after the last
    beat; down once the grace period passed too; draining when drained."""
    node, token = node_create(name="n", address="10.0.0.8")
    assert nodes_now()["n"].status == NodeStatus.PENDING
    node_heartbeat(identity=node_join(name="n", join_token=token))
    assert nodes_now(grace_s=60)["n"].status == NodeStatus.READY
    beat = Node.objects.get(name="n").last_heartbeat
    for age, status in (
        (UNREACHABLE_AFTER_S + 1, NodeStatus.UNREACHABLE),
        (UNREACHABLE_AFTER_S + 61, NodeStatus.DOWN),
    ):
        Node.objects.filter(name="n").update(
            last_heartbeat=beat - timedelta(seconds=age)
        )
        assert nodes_now(grace_s=60)["n"].status == status
    Node.objects.filter(name="n").update(last_heartbeat=beat, draining=True)
    assert nodes_now(grace_s=60)["n"].status == NodeStatus.DRAINING


def test_joining_on_sqlite_says_the_platform_stays_one_node(tmp_path):
    if connection.vendor != "sqlite":
        pytest.skip("the one-node refusal is SQLite's")
    with pytest.raises(ClusterUnavailable, match="needs PostgreSQL"):
        node_join(name="x", join_token="rhj-x")
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "ROUNDHOUSE_RUN_DIR": str(tmp_path),
        "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "supervise", "--node", "x"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "cluster mode needs PostgreSQL" in done.stderr


def test_the_identity_file_is_for_its_user_only(tmp_path):
    from cluster.identity import NodeIdentity

    identity_write(tmp_path, NodeIdentity(name="a", secret="rhn-s"))
    assert (os.stat(tmp_path / "node.json").st_mode & 0o777) == 0o600
    assert identity_read(tmp_path) == NodeIdentity(name="a", secret="rhn-s")
    assert "rhn-s" not in repr(identity_read(tmp_path))
    assert identity_read(tmp_path / "elsewhere") is None


def test_the_admin_shows_the_join_command_once(admin_client):
    """Adding a node shows its join command (the token in an environment
    variable, never an argument) once; the change page does not show it
    again. On SQLite, nodes cannot be added and the list says why."""
    url = reverse("admin:cluster_node_add")
    if connection.vendor != "postgresql":
        assert admin_client.get(url).status_code == 403
        listing = admin_client.get(reverse("admin:cluster_node_changelist"))
        assert "it stays one node" in listing.content.decode()
        return
    response = admin_client.post(
        url,
        {"name": "gpu-2", "address": "10.0.0.9", "relay_port": "8765", "labels": "[]"},
        follow=True,
    )
    shown = [str(m.message) for m in get_messages(response.wsgi_request)]
    command = next(text for text in shown if "ROUNDHOUSE_JOIN_TOKEN=" in text)
    token = command.split("ROUNDHOUSE_JOIN_TOKEN=")[1].split()[0]
    assert "manage.py supervise --node gpu-2" in command
    assert "SECRET_KEY=${SECRET_KEY:?" in command
    assert "must be the same on every host" in command
    # The first host, already running the platform, is told to switch over.
    assert "stop its plain <code>manage.py supervise</code>" in command
    node = Node.objects.get(name="gpu-2")
    assert node.join_token_hash == secret_hash(token)
    page = admin_client.get(reverse("admin:cluster_node_change", args=[node.pk]))
    assert token not in page.content.decode()
    assert "pending" in page.content.decode()


def run_join_command(command: str, exported: dict[str, str]) -> tuple[int, str]:
    """Run a join command in a shell with `exported` in its environment, the
    supervisor replaced by `env` (what it would have been given); its exit
    status and output."""
    shown = command.replace(".venv/bin/python manage.py supervise", "env #")
    ran = subprocess.run(
        ["bash", "-c", shown],
        env={"PATH": os.environ["PATH"], **exported},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return ran.returncode, ran.stdout + ran.stderr


def test_the_join_command_runs_with_this_clusters_values(settings, monkeypatch):
    """The join command carries this cluster's REDIS_URL (its database number
    /5, its port) and DATABASE_URL with every secret (Redis and database
    passwords, SECRET_KEY) and every loopback host as a shell parameter that
    must be set: exported, the command runs and the supervisor gets the
    values every host must share; nothing secret is in the text. Control: run
    as shown without them, the shell refuses it and names what is missing."""
    from cluster.admin import join_command

    settings.REDIS_URL = "redis://:redis-pw-1@127.0.0.1:6390/5"
    settings.SECRET_KEY = "the-real-secret-key"
    database = settings.DATABASES["default"]
    monkeypatch.setitem(database, "USER", "rh")
    monkeypatch.setitem(database, "PASSWORD", "db-pw-1")
    monkeypatch.setitem(database, "HOST", "db.example")
    monkeypatch.setitem(database, "PORT", "5433")
    monkeypatch.setitem(database, "NAME", "roundhouse")
    command = join_command(Node(name="gpu-2"), "rhj-token")
    for secret in ("redis-pw-1", "db-pw-1", "the-real-secret-key"):
        assert secret not in command
    assert "supervise --node gpu-2" in command
    status, shown = run_join_command(
        command,
        {
            "SECRET_KEY": "k1",
            "REDIS_PASSWORD": "rp",
            "REDIS_HOST": "10.0.0.2",
            "DATABASE_PASSWORD": "dp",
        },
    )
    assert status == 0, shown
    given = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    assert given["ROUNDHOUSE_JOIN_TOKEN"] == "rhj-token"
    assert given["SECRET_KEY"] == "k1"
    assert given["REDIS_URL"] == "redis://:rp@10.0.0.2:6390/5"
    assert given["DATABASE_URL"] == "postgres://rh:dp@db.example:5433/roundhouse"
    # Control: the same command with nothing exported does not run.
    status, shown = run_join_command(command, {})
    assert status != 0
    assert "SECRET_KEY" in shown or "PASSWORD" in shown


def test_a_view_only_staff_user_cannot_drain_or_revoke(client, django_user_model):
    """The node actions need the permission to change nodes."""
    from django.contrib.auth.models import Permission

    viewer = django_user_model.objects.create_user(
        "viewer", password="x", is_staff=True
    )
    viewer.user_permissions.add(Permission.objects.get(codename="view_node"))
    node = Node.objects.create(name="n1", address="10.0.0.10")
    client.force_login(viewer)
    order = {"action": "revoke", "_selected_action": [node.pk]}
    client.post(reverse("admin:cluster_node_changelist"), order)
    node.refresh_from_db()
    assert node.revoked_at is None
    # Control: with the permission to change nodes, the same order revokes.
    viewer.user_permissions.add(Permission.objects.get(codename="change_node"))
    client.post(reverse("admin:cluster_node_changelist"), order)
    node.refresh_from_db()
    assert node.revoked_at is not None


@postgres_only
def test_a_nodes_model_copies_show_on_its_page(admin_client):
    """What a heartbeat reports of the copies in progress is on the node's
    change page: how far, from where, the last error; nothing once done."""
    node, token = node_create(name="gpu-3", address="10.0.0.10")
    identity = node_join(name="gpu-3", join_token=token)
    copies = {
        "big": {"done": 45 << 20, "size": 100 << 20, "source": "a", "error": ""},
        "other": {"done": 0, "size": 0, "source": "b", "error": "from b: refused"},
    }
    node_heartbeat(identity=identity, copies=copies)
    page = admin_client.get(reverse("admin:cluster_node_change", args=[node.pk]))
    text = page.content.decode()
    assert "big: 45 of 100 MiB (45%) from a" in text
    assert "last error: from b: refused" in text
    node_heartbeat(identity=identity, copies={})
    page = admin_client.get(reverse("admin:cluster_node_change", args=[node.pk]))
    assert "45 of 100 MiB" not in page.content.decode()  # control: gone when done


@postgres_only
def test_link_proofs_name_only_the_nodes_that_opened_the_links():
    """What a relay rechecks its links against each heartbeat
    (node_link_proofs): a joined node's proof is what its link was opened
    with; revoked, deleted and joined-again nodes no longer match (control:
    the proof before each change matched)."""
    from node_link.relay import link_proof

    from cluster.selectors import node_link_proofs

    identities = {}
    for name, address in (("p1", "10.0.1.1"), ("p2", "10.0.1.2"), ("p3", "10.0.1.3")):
        node, token = node_create(name=name, address=address)
        identities[name] = (node, node_join(name=name, join_token=token))
    opened = {
        name: link_proof(identity.secret) for name, (_, identity) in identities.items()
    }
    assert node_link_proofs(set(opened)) == opened
    node_revoke(node=identities["p1"][0])
    identities["p2"][0].delete()
    Node.objects.filter(name="p3").delete()
    node, token = node_create(name="p3", address="10.0.1.3")
    node_join(name="p3", join_token=token)
    now = node_link_proofs(set(opened))
    assert "p1" not in now and "p2" not in now
    assert now["p3"] != opened["p3"]
