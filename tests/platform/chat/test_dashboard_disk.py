"""What the dashboard shows beside the engines (chat/dashboard.py
dashboard_fleet): this host's disk for models, or each node's, and the model
pulls in progress; on the page as it opens and in every update."""

import json
import re
from datetime import timedelta

import pytest
from django.db.models.functions import Now

from catalog.models import ModelConfig, ModelPull
from chat.dashboard import dashboard_fleet
from cluster.models import Node
from tests.factories import ModelConfigFactory

pytestmark = pytest.mark.django_db

MIB = 2**20


@pytest.fixture
def models_dir(tmp_path, settings):
    folder = tmp_path / "models"
    folder.mkdir()
    settings.MODELS_DIR = folder
    ModelConfig.objects.all().delete()
    return folder


def test_the_fleet_carries_this_hosts_disk_and_the_open_pulls(models_dir):
    """One host: its disk with the model's files. Pulls queued and running
    are listed with their percent, rate and time left; a finished one is
    not (control)."""
    (models_dir / "m.gguf").write_bytes(b"\0" * MIB)
    ModelConfigFactory(name="m", path="m.gguf")
    ModelPull.objects.create(
        source="hf:org/a-GGUF:Q4_K_M",
        name="a",
        node="b",
        status="running",
        size_bytes=200 * MIB,
        done_bytes=50 * MIB,
        rate_bps=10 * MIB,
        left_s=15.0,
    )
    ModelPull.objects.create(source="hf:org/b-GGUF", name="b", status="queued")
    ModelPull.objects.create(source="hf:org/c-GGUF", name="c", status="done")
    fleet = dashboard_fleet()
    (disk,) = fleet["disks"]
    assert disk["node"] == "" and disk["models"] == {"m": 1.0}
    assert disk["free_mib"] > 0
    assert [pull["name"] for pull in fleet["pulls"]] == ["a", "b"]
    running = fleet["pulls"][0]
    assert (running["node"], running["percent"], running["left_s"]) == ("b", 25.0, 15)
    assert running["rate_bps"] == 10 * MIB
    assert running["stalled_s"] is None


def test_a_pull_with_no_bytes_lately_shows_stalled(models_dir):
    """Its last bytes 8 s ago by the database's clock: no rate, no time left,
    and for how long. Control: bytes just now read as written."""
    pull = ModelPull.objects.create(
        source="hf:org/a-GGUF:Q4_K_M",
        name="a",
        status="running",
        size_bytes=200 * MIB,
        done_bytes=50 * MIB,
        rate_bps=10 * MIB,
        left_s=15.0,
    )
    ModelPull.objects.filter(pk=pull.pk).update(
        progress_at=Now() - timedelta(seconds=8)
    )
    (stalled,) = dashboard_fleet()["pulls"]
    assert (stalled["rate_bps"], stalled["left_s"]) == (0.0, None)
    assert 8 <= stalled["stalled_s"] < 60
    ModelPull.objects.filter(pk=pull.pk).update(progress_at=Now())
    (moving,) = dashboard_fleet()["pulls"]
    assert (moving["rate_bps"], moving["left_s"], moving["stalled_s"]) == (
        10 * MIB,
        15.0,
        None,
    )


def test_on_a_cluster_each_nodes_disk_is_its_heartbeats(models_dir):
    """With nodes, the disks are theirs (this host's is not measured)."""
    (models_dir / "m.gguf").write_bytes(b"\0" * MIB)
    ModelConfigFactory(name="m", path="m.gguf")
    Node.objects.create(
        name="a",
        address="10.0.0.1",
        hardware={"disk": {"total_mib": 10, "free_mib": 4, "models": {"x": 1}}},
    )
    (disk,) = dashboard_fleet()["disks"]
    assert disk["node"] == "a" and disk["models"] == {"x": 1}


def test_the_page_opens_with_the_disk_and_the_pulls(models_dir, admin_client):
    """The page's fleet (before its socket opens) has them too."""
    ModelPull.objects.create(source="hf:org/a-GGUF", name="a", status="queued")
    page = admin_client.get("/dashboard/")
    found = re.search(
        r'<script id="fleet-data" type="application/json">(.*?)</script>',
        page.content.decode(),
        re.S,
    )
    fleet = json.loads(found.group(1))
    assert fleet["disks"][0]["node"] == ""
    assert [pull["name"] for pull in fleet["pulls"]] == ["a"]
