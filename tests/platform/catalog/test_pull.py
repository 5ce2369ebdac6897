"""A file from the Hub onto this host (catalog/pull.py), through the real
huggingface_hub client against the local hub (tests/hub.py): whole and in its
place, resumed after a cut with only the rest fetched, a corrupted download
refused and removed, a full disk refused before a byte, a file on disk reused."""

import hashlib
import os
import threading
from pathlib import Path

import pytest

from catalog.hub import HubError, hub_repo
from catalog.pull import PARTIAL, STAGING, model_folder, pull_file
from tests.hub import LocalHub

REPO = "org/weights"
MIB = 1 << 20


@pytest.fixture
def weights() -> bytes:
    """30 MiB that are not all alike (a cut at 40% lands past the client's
    first 10 MiB step, which is what it resumes from)."""
    return hashlib.sha256(b"seed").digest() * (30 * MIB // 32)


@pytest.fixture
def hub(weights):
    with LocalHub({REPO: {"model.Q4_0.gguf": weights, "README.md": b"hi\n"}}) as local:
        yield local


def pull(hub, models_dir: Path, name="model.Q4_0.gguf", **options) -> Path:
    repo = hub_repo(REPO, endpoint=hub.url, token=False)
    [file] = [f for f in repo.files if f.name == name]
    return pull_file(repo, file, models_dir, endpoint=hub.url, token=False, **options)


def staged(models_dir: Path) -> Path:
    """Where the download in progress is kept."""
    return models_dir / STAGING / "org--weights" / ("model.Q4_0.gguf" + PARTIAL)


def test_a_pull_lands_whole_in_its_place_with_progress(hub, weights, tmp_path):
    seen = []
    path = pull(hub, tmp_path, progress=seen.append, margin_bytes=0)
    assert path == model_folder(tmp_path, REPO) / "model.Q4_0.gguf"
    assert path.read_bytes() == weights
    assert seen[-1].done == seen[-1].size == len(weights)
    assert all(a.done <= b.done for a, b in zip(seen, seen[1:], strict=False))
    assert not staged(tmp_path).exists()  # moved, not copied
    # Pulled again: the file on disk is reused, nothing fetched.
    served = hub.bytes_served(REPO, "model.Q4_0.gguf")
    assert pull(hub, tmp_path, margin_bytes=0) == path
    assert hub.bytes_served(REPO, "model.Q4_0.gguf") == served


def test_a_cut_pull_resumes_with_only_the_rest(hub, weights, tmp_path):
    """The connection cut at 40% on every try: the pull fails and keeps what
    it had; the next pull fetches the rest (from the client's last 10 MiB
    step), not the whole file again (control: bytes served counted)."""
    hub.cut(REPO, "model.Q4_0.gguf", fraction=0.4, times=100)
    with pytest.raises(HubError) as cut:
        pull(hub, tmp_path, margin_bytes=0)
    assert cut.value.status == 502
    kept = staged(tmp_path).stat().st_size
    assert kept >= 10 * MIB
    hub.cut(REPO, "model.Q4_0.gguf", fraction=0.4, times=0)
    before = hub.bytes_served(REPO, "model.Q4_0.gguf")
    path = pull(hub, tmp_path, margin_bytes=0)
    assert path.read_bytes() == weights
    assert hub.bytes_served(REPO, "model.Q4_0.gguf") - before == len(weights) - kept
    # Control: without the partial file the same pull fetches it all again.
    path.unlink()
    before = hub.bytes_served(REPO, "model.Q4_0.gguf")
    pull(hub, tmp_path, margin_bytes=0)
    assert hub.bytes_served(REPO, "model.Q4_0.gguf") - before == len(weights)


def test_a_corrupted_download_is_refused_and_removed(hub, tmp_path):
    hub.corrupt(REPO, "model.Q4_0.gguf", offset=5 * MIB)
    with pytest.raises(HubError) as refused:
        pull(hub, tmp_path, margin_bytes=0)
    assert refused.value.status == 502 and "SHA-256" in refused.value.message
    assert not (model_folder(tmp_path, REPO) / "model.Q4_0.gguf").exists()
    assert not staged(tmp_path).exists()


def test_no_room_is_refused_before_a_byte(hub, tmp_path):
    """A margin larger than the disk's free space: refused with the figures,
    nothing fetched; control: with no margin the same pull succeeds."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(HubError) as full:
        pull(hub, tmp_path, margin_bytes=free)
    assert full.value.status == 507 and "GiB free" in full.value.message
    assert hub.bytes_served(REPO, "model.Q4_0.gguf") == 0
    assert pull(hub, tmp_path, margin_bytes=0).is_file()


def test_a_revision_that_moves_mid_pull_keeps_the_pinned_commit(hub, weights, tmp_path):
    """`main` moves to a commit with other weights while the pull is held
    mid-file: the pull finishes with the commit it started from (control: a
    pull planned after the move gets the new weights)."""
    repo = hub_repo(REPO, endpoint=hub.url, token=False)
    [file] = [f for f in repo.files if f.name == "model.Q4_0.gguf"]
    stall = hub.stall(REPO, "model.Q4_0.gguf")
    done: dict = {}

    def pulling() -> None:
        done["path"] = pull_file(
            repo, file, tmp_path, endpoint=hub.url, token=False, margin_bytes=0
        )

    worker = threading.Thread(target=pulling)
    worker.start()
    assert stall.reached.wait(30)
    moved = bytes(reversed(weights))
    hub.push(REPO, {"model.Q4_0.gguf": moved, "README.md": b"hi\n"})
    stall.release.set()
    worker.join(60)
    assert done["path"].read_bytes() == weights
    again = hub_repo(REPO, endpoint=hub.url, token=False)
    assert again.commit != repo.commit
    [new] = [f for f in again.files if f.name == "model.Q4_0.gguf"]
    assert new.sha256 != file.sha256
    (model_folder(tmp_path, REPO) / "model.Q4_0.gguf").unlink()
    path = pull_file(
        again, new, tmp_path, endpoint=hub.url, token=False, margin_bytes=0
    )
    assert path.read_bytes() == moved


def test_the_hash_kept_while_writing_follows_a_restart_from_the_first_byte(tmp_path):
    """What an earlier pull left is hashed first; when a server answers a
    range request with the whole file, the client truncates the partial file
    and writes from the start: the hash starts over with it. Control: the
    digest equals a read of the file, each time."""
    from catalog.pull import _Hashing

    path = tmp_path / "f.partial"
    path.write_bytes(b"old-part")
    with open(path, "ab") as out, _Hashing(out, path) as hashed:
        hashed.write(b"-more")
        out.flush()
        assert hashed.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
        resumed_from = path.stat().st_size  # a later try, from 13 bytes: a 200
        hashed.seek(max(hashed.tell() - resumed_from, 0))  # as http_get does
        hashed.truncate()
        hashed.write(b"whole file")
    assert path.read_bytes() == b"whole file"
    assert hashed.hexdigest() == hashlib.sha256(b"whole file").hexdigest()
