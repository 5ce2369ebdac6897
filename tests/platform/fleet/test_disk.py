"""A host's disk for models (fleet/disk.py): the report each heartbeat sends
(the filesystem's numbers and each model's files, against a real folder; a
path that cannot be read leaves that model out alone), and deleting a model's
files from this host: refused while loaded or placed here, only under the
models directory, never another model's file."""

import json
import os
import shutil
from pathlib import Path

import pytest
from django.utils import timezone

from catalog.models import ModelConfig, ModelPull
from cluster.identity import NodeIdentity, identity_write
from cluster.models import Node
from fleet.disk import (
    MIB,
    DiskReports,
    ModelInUse,
    disk_measure,
    disks_overview,
    model_files_delete,
    model_files_plan,
)
from fleet.membership import hardware_now
from fleet.models import EngineState
from tests.factories import EngineSpecFactory, ModelConfigFactory

pytestmark = pytest.mark.django_db


def write(path: Path, size: int) -> Path:
    """A file of `size` bytes (its folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return path


@pytest.fixture
def models_dir(tmp_path, settings) -> Path:
    """An empty models directory, and a run dir of this host's own."""
    folder = tmp_path / "models"
    folder.mkdir()
    settings.MODELS_DIR = folder
    settings.RUN_DIR = tmp_path / "run"
    settings.RUN_DIR.mkdir()
    ModelConfig.objects.all().delete()  # the demo rows: paths of their own
    return folder


def test_the_report_measures_each_models_files_and_the_disk(models_dir):
    """A GGUF file with its projector, a folder of two files (and a link in
    it to one of them, counted once) and a model at an absolute path are
    measured in MiB; the filesystem's numbers are the models directory's.
    Control: a model whose files are not here is absent."""
    write(models_dir / "org--a" / "a.gguf", 3 * MIB)
    write(models_dir / "org--a" / "mmproj.gguf", 1 * MIB)
    write(models_dir / "b" / "model.safetensors", 2 * MIB)
    write(models_dir / "b" / "config.json", MIB // 2)
    os.symlink(models_dir / "b" / "config.json", models_dir / "b" / "again.json")
    outside = write(models_dir.parent / "elsewhere.gguf", MIB // 4)
    ModelConfigFactory(name="a", path="org--a/a.gguf", projector="org--a/mmproj.gguf")
    ModelConfigFactory(name="b", path="b", format="transformers")
    ModelConfigFactory(name="far", path=str(outside))
    ModelConfigFactory(name="missing", path="org--c/c.gguf")
    report = disk_measure()
    assert report["models"] == {"a": 4.0, "b": 2.5, "far": 0.25}
    assert "missing" not in report["models"]  # control
    usage = shutil.disk_usage(models_dir)
    assert report["models_dir"] == str(models_dir)
    assert report["total_mib"] == round(usage.total / MIB)
    assert 0 < report["free_mib"] <= report["total_mib"]
    assert 0 < report["used_mib"] <= report["total_mib"]
    assert report["unreadable"] == {}


def test_a_path_that_cannot_be_read_leaves_that_model_out_alone(models_dir):
    """A link that loops and a path through a file raise when read: those
    two models are left out, named with why, and the report goes on to
    measure the others (control: the good model is measured)."""
    write(models_dir / "good.gguf", MIB)
    os.symlink(models_dir / "loop", models_dir / "loop")
    write(models_dir / "plain", 10)
    ModelConfigFactory(name="good", path="good.gguf")
    ModelConfigFactory(name="loops", path="loop")
    ModelConfigFactory(name="through-a-file", path="plain/inside.gguf")
    report = disk_measure()
    assert report["models"] == {"good": 1.0}
    assert set(report["unreadable"]) == {"loops", "through-a-file"}
    assert report["total_mib"] > 0


def test_the_heartbeats_hardware_carries_free_memory_and_the_disk(
    models_dir, tmp_path, settings
):
    """hardware_now(): RAM free beside its total, each card's free memory
    (the probes' file), and the disk report with the model here; a model
    whose path raises is left out of it, and the report still comes."""
    cards = tmp_path / "cards.json"
    cards.write_text(
        json.dumps({"gpus": [{"id": "GPU-1", "total_mib": 8192, "used_mib": 1000}]})
    )
    settings.ROUNDHOUSE_DEVICE_MEMORY_FILE = str(cards)
    write(models_dir / "here.gguf", 2 * MIB)
    ModelConfigFactory(name="here", path="here.gguf")
    os.symlink(models_dir / "loop", models_dir / "loop")
    ModelConfigFactory(name="loops", path="loop")  # raises when read: left out
    hardware = hardware_now()
    assert 0 < hardware["ram_free_mib"] <= hardware["ram_mib"]
    assert hardware["gpus"][0]["free_mib"] == 7192
    assert hardware["gpus"][0]["memory_mib"] == 8192
    assert hardware["disk"]["models"] == {"here": 2.0}
    assert "loops" in hardware["disk"]["unreadable"]


def test_a_report_is_measured_again_only_once_it_is_old(models_dir):
    """Within its age a report is the kept one (a model added since is not
    in it); forgotten, or with no age allowed, it is measured again."""
    write(models_dir / "first.gguf", MIB)
    ModelConfigFactory(name="first", path="first.gguf")
    reports = DiskReports(every_s=3600)
    assert set(reports.report()["models"]) == {"first"}
    write(models_dir / "second.gguf", MIB)
    ModelConfigFactory(name="second", path="second.gguf")
    assert set(reports.report()["models"]) == {"first"}  # kept
    reports.forget()
    assert set(reports.report()["models"]) == {"first", "second"}
    write(models_dir / "third.gguf", MIB)
    ModelConfigFactory(name="third", path="third.gguf")
    assert len(DiskReports(every_s=0).report()["models"]) == 3  # control


def test_the_overview_is_this_hosts_disk_or_each_nodes(models_dir):
    """Without nodes: this host's report, measured here. With nodes: each
    node's as its heartbeat sent it (one that sent none has no numbers)."""
    write(models_dir / "m.gguf", MIB)
    ModelConfigFactory(name="m", path="m.gguf")
    (here,) = disks_overview()
    assert here["node"] == "" and here["models"] == {"m": 1.0}
    Node.objects.create(
        name="a",
        address="10.0.0.1",
        hardware={"disk": {"total_mib": 100, "free_mib": 60, "used_mib": 40}},
    )
    Node.objects.create(name="b", address="10.0.0.2")
    a, b = disks_overview()
    assert (a["node"], a["free_mib"]) == ("a", 60)
    assert b == {"node": "b"}


# -- deleting ---------------------------------------------------------------------


def loaded(model: str, *, engine: str = "cpu0", status: str = "ready", node=None):
    """An engine of this host whose last state lists `model` resident."""
    spec = EngineSpecFactory(name=engine, capabilities=["gguf"], node=node)
    return EngineState.objects.create(
        spec=spec, status=status, resident_models=[{"name": model}]
    )


def test_a_loaded_model_is_refused_with_the_reason(models_dir):
    """While an engine of this host holds it: ModelInUse naming the engine,
    and nothing deleted. Control: once its engine is stopped the same
    delete frees exactly the files' bytes."""
    gguf = write(models_dir / "org--m" / "m.gguf", 3 * MIB)
    model = ModelConfigFactory(name="m", path="org--m/m.gguf")
    state = loaded("m")
    with pytest.raises(ModelInUse, match="loaded on cpu0"):
        model_files_delete(model=model)
    assert gguf.exists()
    state.status = "stopped"
    state.save()
    assert model_files_delete(model=model) == 3 * MIB
    assert not gguf.exists()
    assert not (models_dir / "org--m").exists()  # its folder left empty: gone
    assert models_dir.exists()


def test_a_model_placed_on_this_nodes_engine_is_refused(models_dir, settings):
    """On a node (its identity in the run dir), a model whose replica is
    placed on the node's engine is refused, naming the engine and the
    replica; control: on another node's host the same model is deleted."""
    write(models_dir / "p.gguf", MIB)
    node = Node.objects.create(
        name="a",
        address="10.0.0.1",
        joined_at=timezone.now(),
        last_heartbeat=timezone.now(),
    )
    EngineSpecFactory(name="cpu-a", capabilities=["gguf"], node=node)
    model = ModelConfigFactory(name="p", path="p.gguf", engine_pin="cpu-a")
    identity_write(settings.RUN_DIR, NodeIdentity(name="a", secret="s" * 32))
    with pytest.raises(ModelInUse, match=r"placed on cpu-a \(replica 1\)"):
        model_files_delete(model=model)
    assert (models_dir / "p.gguf").exists()
    identity_write(settings.RUN_DIR, NodeIdentity(name="b", secret="s" * 32))
    assert model_files_delete(model=model) == MIB


def test_only_the_models_own_files_under_the_models_dir_are_deleted(models_dir):
    """The model's file, its projector and a pull's partial file go (bytes
    freed: their sizes together); a projector outside the models directory
    and a file another model uses stay, listed as kept with why."""
    write(models_dir / "org--v" / "v.gguf", 2 * MIB)
    write(models_dir / ".pulls" / "org--v" / "v.gguf.partial", MIB // 2)
    write(models_dir / "org--v" / "mmproj.gguf", MIB)
    outside = write(models_dir.parent / "outside-mmproj.gguf", MIB)
    shared = write(models_dir / "shared.gguf", MIB)
    vision = ModelConfigFactory(
        name="v", path="org--v/v.gguf", projector="org--v/mmproj.gguf"
    )
    far = ModelConfigFactory(name="far", path="shared.gguf", projector=str(outside))
    ModelConfigFactory(name="twin", path=str(shared))  # the same file, spelt so
    plan = model_files_plan(model=far)
    assert plan.removed == []
    assert {why for _, why in plan.kept} == {
        "outside the models directory",
        "another model's files too",
    }
    assert model_files_delete(model=far) == 0
    assert outside.exists() and shared.exists()
    assert model_files_delete(model=vision) == 2 * MIB + MIB // 2 + MIB
    assert not (models_dir / "org--v").exists()
    assert not (models_dir / ".pulls" / "org--v").exists()
    assert (models_dir / ".pulls").exists()  # the staging folder itself stays
    assert outside.exists() and shared.exists()  # control: still there


def test_a_folder_inside_another_models_folder_is_kept(models_dir):
    """A model whose folder holds another model's file keeps the folder."""
    write(models_dir / "repo" / "a.gguf", MIB)
    write(models_dir / "repo" / "b.gguf", MIB)
    whole = ModelConfigFactory(name="whole", path="repo")
    ModelConfigFactory(name="part", path="repo/b.gguf")
    assert model_files_delete(model=whole) == 0
    assert (models_dir / "repo" / "a.gguf").exists()


def test_a_model_whose_folder_a_pull_writes_into_is_refused(models_dir):
    """A pull in flight of the same repository (its partial files and the
    file it finishes are in the model's folder): refused, naming the pull;
    control: once that pull is over the model's files are deleted."""
    write(models_dir / "org--r" / "r.Q4_K_M.gguf", MIB)
    model = ModelConfigFactory(name="r", path="org--r/r.Q4_K_M.gguf")
    pull = ModelPull.objects.create(
        source="hf:org/r:Q8_0",
        name="r-q8",
        status="running",
        plan={"repo_id": "org/r"},
    )
    with pytest.raises(ModelInUse, match=r"being pulled .*the pull of r-q8"):
        model_files_delete(model=model)
    pull.status = "done"
    pull.save()
    assert model_files_delete(model=model) == MIB
