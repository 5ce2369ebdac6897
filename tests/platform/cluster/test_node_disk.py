"""A node's disk for models in the admin: what its heartbeat reported (the
models directory's used and free room, each model's files with their size,
what could not be measured) on its page and as a column of the list."""

import pytest
from django.urls import reverse

from cluster.models import Node

pytestmark = pytest.mark.django_db

DISK = {
    "models_dir": "/srv/models",
    "total_mib": 102400,
    "free_mib": 61440,
    "used_mib": 40960,
    "models": {"smol": 92.4, "big": 4505.0},
    "unreadable": {"odd": "[Errno 40] Too many levels of symbolic links"},
}


def test_a_nodes_page_shows_its_disk_and_each_models_files(admin_client):
    """Used and free of the total, each model with its size, and a model
    that could not be measured with why. Control: a node that reported no
    disk says so, with none of those numbers."""
    node = Node.objects.create(
        name="gpu-3", address="10.0.0.10", hardware={"cores": 8, "disk": DISK}
    )
    page = admin_client.get(reverse("admin:cluster_node_change", args=[node.pk]))
    text = page.content.decode()
    assert "/srv/models: 40.0 GiB used, 60.0 GiB free of 100.0 GiB" in text
    assert "<td>smol</td><td>92 MiB</td>" in text
    assert "<td>big</td><td>4.4 GiB</td>" in text
    assert "odd could not be measured: [Errno 40]" in text
    silent = Node.objects.create(name="gpu-4", address="10.0.0.11")
    page = admin_client.get(reverse("admin:cluster_node_change", args=[silent.pk]))
    text = page.content.decode()
    assert "not reported yet" in text
    assert "GiB used" not in text


def test_the_node_list_shows_each_nodes_free_disk_and_memory(admin_client):
    """The list's columns: the disk's free room of its total, the RAM and
    each card's memory free beside their totals. Control: a node without a
    report shows neither."""
    hardware = {
        "cores": 8,
        "ram_mib": 16384,
        "ram_free_mib": 6144,
        "gpus": [{"vendor": "nvidia", "memory_mib": 8192, "free_mib": 7000}],
        "disk": DISK,
    }
    Node.objects.create(name="gpu-3", address="10.0.0.10", hardware=hardware)
    Node.objects.create(name="gpu-4", address="10.0.0.11")
    text = admin_client.get(reverse("admin:cluster_node_changelist")).content.decode()
    assert "60.0 GiB of 100.0 GiB" in text
    assert "8 cores, 16 GiB (6.0 GiB free), nvidia 8192 MiB (7000 MiB free)" in text
    assert text.count("60.0 GiB of 100.0 GiB") == 1
    assert text.count("GiB free)") == 1
