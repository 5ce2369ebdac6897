"""A pull on a small disk the test mounts (tmpfs, as root): refused before a
byte when the file and the margin do not fit; stopped with what it fetched
kept when another writer fills the disk to under half the margin; and, when
the disk fills up completely mid-write, stopped with its partial file
removed so that the rest of the disk gets its room back. In every case the
other writer's file is untouched and the message says what happened."""

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from catalog import pull as pull_module
from catalog.hub import HubError, hub_repo
from catalog.pull import PARTIAL, STAGING, pull_file
from tests.hub import LocalHub

REPO = "org/weights"
FILE = "model.Q4_0.gguf"
MIB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A folder on its own 64 MiB filesystem, removed after the test."""
    if os.geteuid() != 0:
        if os.environ.get("ROUNDHOUSE_REQUIRE_NETNS") == "1":
            pytest.fail("mounting a small filesystem needs root")
        pytest.skip("mounting a small filesystem needs root")
    folder = tmp_path / "small"
    folder.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(folder)],
        check=True,
    )
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def weights() -> bytes:
    return hashlib.sha256(b"disk").digest() * (30 * MIB // 32)


@pytest.fixture
def hub(weights):
    with LocalHub({REPO: {FILE: weights}}) as local:
        yield local


def pull(hub, models_dir: Path, **options) -> Path:
    repo = hub_repo(REPO, endpoint=hub.url, token=False)
    [file] = [f for f in repo.files if f.name == FILE]
    return pull_file(repo, file, models_dir, endpoint=hub.url, token=False, **options)


def partial(models_dir: Path) -> Path:
    return models_dir / STAGING / "org--weights" / (FILE + PARTIAL)


def fill(folder: Path, leave_bytes: int) -> Path:
    """Another writer's file, taking all but about `leave_bytes` of the disk
    (a MiB at a time, stopping where the disk is full)."""
    filler = folder / "someone-else.bin"
    with filler.open("wb", buffering=0) as out:
        while shutil.disk_usage(folder).free - MIB >= leave_bytes:
            try:
                out.write(b"x" * MIB)
            except OSError:
                break
    return filler


def held_pull(hub, models_dir: Path, **options):
    """A pull the hub holds at 40% of the file: its thread, the stall to
    release, and a list its outcome goes to."""
    stall = hub.stall(REPO, FILE)
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(pull(hub, models_dir, **options))
        except HubError as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    assert stall.reached.wait(timeout=60), "the download never reached the stall"
    return thread, stall, outcome


def test_a_file_the_disk_cannot_hold_is_refused_before_a_byte(hub, small_disk):
    """Control: with room for it, the same file is pulled."""
    with pytest.raises(HubError, match="needs 0.03 GiB more") as refused:
        pull(hub, small_disk, margin_bytes=40 * MIB)
    assert refused.value.status == 507
    assert hub.bytes_served(REPO, FILE) == 0
    assert pull(hub, small_disk, margin_bytes=8 * MIB).stat().st_size == 30 * MIB


def test_a_disk_filled_by_another_writer_stops_the_pull_and_keeps_its_part(
    hub, small_disk, monkeypatch
):
    """With a 32 MiB margin, another writer leaves 12 MiB free mid-download:
    the pull stops at its next look at the disk (not at the disk's end),
    keeping what it fetched. Control: once the other file is gone, the pull
    continues from it."""
    monkeypatch.setattr(pull_module, "DISK_CHECK_EVERY_S", 0.0)  # each chunk
    thread, stall, outcome = held_pull(hub, small_disk, margin_bytes=32 * MIB - 1)
    filler = fill(small_disk, 12 * MIB)
    size = filler.stat().st_size
    stall.release.set()
    thread.join(timeout=120)
    [error] = outcome
    assert isinstance(error, HubError) and error.status == 507
    assert "nearly full" in error.message and "keeping what it fetched" in error.message
    kept = partial(small_disk).stat().st_size
    assert kept > 0
    assert filler.stat().st_size == size
    filler.unlink()
    served = hub.bytes_served(REPO, FILE)
    assert pull(hub, small_disk, margin_bytes=8 * MIB).stat().st_size == 30 * MIB
    assert hub.bytes_served(REPO, FILE) - served == 30 * MIB - kept


def test_a_disk_that_fills_up_mid_write_gets_its_room_back(hub, small_disk):
    """No margin: another writer takes all but 1 MiB mid-download; the next
    write fails (ENOSPC) and the pull stops with a clear message, its partial
    file removed: the disk has its room back, the other file is whole."""
    thread, stall, outcome = held_pull(hub, small_disk, margin_bytes=0)
    filler = fill(small_disk, 1 * MIB)
    size = filler.stat().st_size
    fetched = partial(small_disk).stat().st_size
    stall.release.set()
    thread.join(timeout=120)
    [error] = outcome
    assert isinstance(error, HubError) and error.status == 507
    assert "the disk filled up during the download" in error.message
    assert not partial(small_disk).exists()
    assert filler.stat().st_size == size
    assert fetched > 0 and shutil.disk_usage(small_disk).free >= fetched
