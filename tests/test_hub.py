"""The local Hub answers the real huggingface_hub client the way the Hub does:
metadata, downloads, ranges, gating, errors, and the faults tests inject."""

import hashlib
import threading
from pathlib import Path

import pytest
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import get_session

from tests.conftest import ROOT
from tests.hub import LocalHub
from tests.waiting import wait_for

REPO = "roundhouse/tiny"
GATED = "roundhouse/gated"
CONFIG = b'{"architectures": ["Tiny"]}\n'
# In LFS by its suffix, like weights on the Hub; big enough for several chunks.
WEIGHTS = bytes(range(256)) * 4096 + b"tail"
GGUF = ROOT / "var" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def hub():
    """A local Hub with one open and one gated repository."""
    files = {"config.json": CONFIG, "weights.bin": WEIGHTS, "docs/README.md": b"hi"}
    with LocalHub({REPO: files, GATED: files}, gated={GATED}) as hub:
        yield hub


def download(hub: LocalHub, cache: Path, filename: str, **kwargs) -> Path:
    """The real client's download of `filename` from the local Hub."""
    kwargs.setdefault("repo_id", REPO)
    kwargs.setdefault("token", False)
    return Path(
        hf_hub_download(filename=filename, endpoint=hub.url, cache_dir=cache, **kwargs)
    )


def test_model_info_lists_files_with_sizes_and_sha256(hub):
    """model_info(files_metadata=True) gives every file's size, LFS files' sha256."""
    info = HfApi(endpoint=hub.url, token=False).model_info(
        REPO, revision="main", files_metadata=True
    )
    assert info.id == REPO
    assert info.sha == hub.commit_sha(REPO)
    siblings = {sibling.rfilename: sibling for sibling in info.siblings}
    assert sorted(siblings) == ["config.json", "docs/README.md", "weights.bin"]
    assert siblings["config.json"].size == len(CONFIG)
    assert siblings["config.json"].lfs is None
    assert siblings["weights.bin"].size == len(WEIGHTS)
    assert siblings["weights.bin"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert siblings["weights.bin"].lfs.size == len(WEIGHTS)


def test_list_repo_files_lists_nested_files(hub):
    """list_repo_files walks the tree recursively."""
    files = HfApi(endpoint=hub.url, token=False).list_repo_files(REPO)
    assert sorted(files) == ["config.json", "docs/README.md", "weights.bin"]


def test_download_is_byte_identical(hub, tmp_path):
    """A small git file and an LFS file come back byte for byte, at the commit."""
    config = download(hub, tmp_path, "config.json")
    weights = download(hub, tmp_path, "weights.bin")
    assert config.read_bytes() == CONFIG
    assert weights.read_bytes() == WEIGHTS
    assert weights.parent.name == hub.commit_sha(REPO)
    assert hub.bytes_served(REPO, "weights.bin") == len(WEIGHTS)


def test_download_of_a_real_model_is_byte_identical(tmp_path):
    """A real 100 MB GGUF, served from its path, arrives identical."""
    if not GGUF.exists():
        pytest.skip(f"{GGUF} missing: run `make test`")
    with LocalHub({REPO: {GGUF.name: GGUF}}) as hub:
        path = download(hub, tmp_path, GGUF.name)
        sha256 = hub.blob(REPO, GGUF.name).sha256
    assert path.stat().st_size == GGUF.stat().st_size
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256
    assert sha256 == hashlib.sha256(GGUF.read_bytes()).hexdigest()


def test_metadata_of_an_lfs_file_comes_from_the_redirect(hub):
    """HEAD on resolve gives the commit, the sha256 as etag, the size, and the
    CDN location the client downloads from."""
    url = hf_hub_url(REPO, "weights.bin", endpoint=hub.url)
    metadata = get_hf_file_metadata(url, token=False, endpoint=hub.url)
    assert metadata.commit_hash == hub.commit_sha(REPO)
    assert metadata.etag == hashlib.sha256(WEIGHTS).hexdigest()
    assert metadata.size == len(WEIGHTS)
    assert metadata.location.startswith(hub.cdn_url)


def test_range_read_returns_the_slice(hub):
    """A Range request gets 206 and exactly the bytes asked for."""
    url = hf_hub_url(REPO, "weights.bin", endpoint=hub.url)
    location = get_hf_file_metadata(url, token=False, endpoint=hub.url).location
    response = get_session().get(location, headers={"Range": "bytes=1000-1999"})
    assert response.status_code == 206
    assert response.headers["Content-Range"] == f"bytes 1000-1999/{len(WEIGHTS)}"
    assert response.content == WEIGHTS[1000:2000]


def test_gated_repo_needs_the_token(hub, tmp_path):
    """Without the token a gated repo's file raises GatedRepoError; with it, it
    downloads. Its metadata stays public, as on the Hub."""
    with pytest.raises(GatedRepoError):
        download(hub, tmp_path, "config.json", repo_id=GATED)
    with pytest.raises(GatedRepoError):
        download(hub, tmp_path, "config.json", repo_id=GATED, token="hf_wrong")
    assert HfApi(endpoint=hub.url, token=False).model_info(GATED).gated == "manual"
    path = download(hub, tmp_path, "config.json", repo_id=GATED, token=hub.token)
    assert path.read_bytes() == CONFIG


def test_unknown_repo_revision_and_file_raise_the_clients_errors(hub, tmp_path):
    """404s carry the X-Error-Code the client maps to its exceptions."""
    with pytest.raises(RepositoryNotFoundError) as missing_repo:
        download(hub, tmp_path, "config.json", repo_id="roundhouse/absent")
    assert missing_repo.type is RepositoryNotFoundError
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=False).model_info("roundhouse/absent")
    with pytest.raises(RevisionNotFoundError):
        download(hub, tmp_path, "config.json", revision="no-such-branch")
    with pytest.raises(EntryNotFoundError):
        download(hub, tmp_path, "absent.json")


def test_cut_transfer_resumes_from_the_last_whole_chunk(tmp_path):
    """After a cut at 40 % the client resumes with a Range request from the last
    whole chunk it wrote: the file is whole and only that tail is served again."""
    big = bytes(range(256)) * (120 * 1024)  # 30 MiB: three client chunks
    with LocalHub({REPO: {"big.bin": big}}) as hub:
        hub.cut(REPO, "big.bin")
        path = download(hub, tmp_path, "big.bin")
        served = hub.bytes_served(REPO, "big.bin")
        ranges = [r for method, _, r in hub.requests if method == "GET" and r]
    cut_at = int(len(big) * 0.4)
    resumed_at = cut_at // DOWNLOAD_CHUNK_SIZE * DOWNLOAD_CHUNK_SIZE
    assert 0 < resumed_at < cut_at
    assert path.read_bytes() == big
    assert ranges == [f"bytes={resumed_at}-"]
    assert served == cut_at + len(big) - resumed_at


def test_cut_before_a_whole_chunk_restarts_from_zero(hub, tmp_path):
    """A file cut before the client's first whole chunk is fetched again from
    the start, with no Range: nothing of it had reached the disk."""
    hub.cut(REPO, "weights.bin")
    path = download(hub, tmp_path, "weights.bin")
    assert path.read_bytes() == WEIGHTS
    assert hub.bytes_served(REPO, "weights.bin") == int(len(WEIGHTS) * 0.4) + len(
        WEIGHTS
    )
    assert not [r for _, _, r in hub.requests if r]


def test_cut_every_transfer_makes_the_download_fail(hub, tmp_path):
    """When every transfer is cut the client retries, then gives up and raises."""
    hub.cut(REPO, "weights.bin", times=100)
    with pytest.raises(Exception, match="peer closed connection"):
        download(hub, tmp_path, "weights.bin")
    gets = [path for method, path, _ in hub.requests if method == "GET"]
    assert len(gets) > 1
    assert hub.bytes_served(REPO, "weights.bin") == len(gets) * int(len(WEIGHTS) * 0.4)


def test_stalled_download_keeps_its_commit_when_main_moves(hub, tmp_path):
    """A download held mid-body while main moves finishes with the old commit's
    bytes; the next download gets the new commit."""
    old_sha = hub.commit_sha(REPO)
    stall = hub.stall(REPO, "weights.bin")
    result: list[Path] = []
    worker = threading.Thread(
        target=lambda: result.append(download(hub, tmp_path, "weights.bin"))
    )
    worker.start()
    try:
        assert stall.reached.wait(timeout=30), "the transfer never reached the stall"
        assert hub.bytes_served(REPO, "weights.bin") == stall.at
        new_sha = hub.push(REPO, {"weights.bin": WEIGHTS[::-1]})
    finally:
        stall.release.set()
        worker.join(timeout=30)
    wait_for(lambda: result, what="the stalled download to finish")
    assert result[0].read_bytes() == WEIGHTS
    assert result[0].parent.name == old_sha
    moved = download(hub, tmp_path, "weights.bin")
    assert moved.read_bytes() == WEIGHTS[::-1]
    assert moved.parent.name == new_sha != old_sha


def test_corrupted_byte_fails_the_identity_check(hub, tmp_path):
    """Control: with one flipped byte the download differs from the source and
    from the listed sha256, and the client itself does not notice."""
    hub.corrupt(REPO, "weights.bin", offset=12345)
    path = download(hub, tmp_path, "weights.bin")
    data = path.read_bytes()
    assert len(data) == len(WEIGHTS)
    assert data != WEIGHTS
    assert [i for i in range(len(data)) if data[i] != WEIGHTS[i]] == [12345]
    assert hashlib.sha256(data).hexdigest() != hub.blob(REPO, "weights.bin").sha256
