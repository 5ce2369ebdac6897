"""Model files copied over a node link (engines/wire/link_files.py): a real
relay on loopback serving a model directory and a one-file model, the copying
side over a real link, in pinned TLS as between nodes."""

import contextlib
import os
from pathlib import Path

import pytest

from cluster.tls import relay_certificate, server_tls_context
from engines.wire import link_files
from engines.wire.link import LinkRefused
from engines.wire.link_client import LinkPool, Peer
from engines.wire.link_files import (
    CopyFailed,
    copy_model,
    relative_part,
)
from tests.engines.file_relay import file_relay, files_opener

SECRET = "files-test-secret"
ONE_FILE = (2 << 20) + 12345  # three ranges of 1 MiB


@pytest.fixture
def served(tmp_path):
    """Node b's models: `dir-model` (a directory, one file spanning several
    ranges), `one-file` (one file), `linked` (a directory holding a symbolic
    link out of it), and `gone` (in the catalog, no files)."""
    root = tmp_path / "b-models"
    (root / "dir-model" / "sub").mkdir(parents=True)
    (root / "dir-model" / "config.json").write_text('{"a": 1}')
    (root / "dir-model" / "sub" / "weights.bin").write_bytes(os.urandom(3 << 20))
    (root / "dir-model" / "empty.txt").write_bytes(b"")
    (root / "one-file.gguf").write_bytes(os.urandom(ONE_FILE))
    (root / "linked").mkdir()
    (root / "linked" / "ok.txt").write_text("ok")
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("not a model")
    (root / "linked" / "escape.txt").symlink_to(secret_file)
    paths = {
        "dir-model": root / "dir-model",
        "one-file": root / "one-file.gguf",
        "linked": root / "linked",
        "gone": root / "gone",
    }
    return paths


@contextlib.asynccontextmanager
async def relay_serving(paths: dict[str, Path], tmp_path: Path):
    """Node b's relay serving `paths` in pinned TLS; yields a files opener."""
    key, cert, fingerprint = relay_certificate(tmp_path / "tls", "b")
    relay, port = await file_relay(
        paths, secret=SECRET, tls=server_tls_context(key, cert)
    )
    pool = LinkPool(node="a", secret=SECRET)
    peer = Peer(node="b", host="127.0.0.1", port=port, tls_fingerprint=fingerprint)
    try:
        yield files_opener(pool, peer)
    finally:
        pool.close()
        await relay.close()


def tree(root: Path) -> dict[str, bytes]:
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


async def test_a_model_directory_is_copied_whole_with_progress(
    served, tmp_path, monkeypatch
):
    """Every file arrives equal, range by range (progress rises to the total),
    and only the finished copy appears at the model's path."""
    monkeypatch.setattr(link_files, "MAX_RANGE", 1 << 20)
    dest = tmp_path / "a-models" / "dir-model"
    seen = []

    async with relay_serving(served, tmp_path) as open_stream:
        await copy_model(
            open_stream, "dir-model", dest, progress=lambda *p: seen.append(p)
        )
    assert tree(dest) == tree(served["dir-model"])
    total = (3 << 20) + len('{"a": 1}')
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert len(seen) >= 5  # 3 ranges of the weights, one of config.json
    assert [p[0] for p in seen] == sorted(p[0] for p in seen)
    assert sorted(os.listdir(dest.parent)) == ["dir-model"]  # no staging left


async def test_a_one_file_model_is_copied(served, tmp_path):
    dest = tmp_path / "a-models" / "one-file.gguf"
    async with relay_serving(served, tmp_path) as open_stream:
        await copy_model(open_stream, "one-file", dest, progress=lambda *p: None)
    assert dest.read_bytes() == served["one-file"].read_bytes()


async def test_an_interrupted_copy_resumes_where_it_stopped(
    served, tmp_path, monkeypatch
):
    """The staged part of a copy cut short is kept; the next copy asks only
    for the rest (control: the first copy asked for everything)."""
    monkeypatch.setattr(link_files, "MAX_RANGE", 1 << 20)
    dest = tmp_path / "a-models" / "one-file.gguf"
    asked = []
    cut = [True]
    real = link_files._ask_range

    async def counting(open_stream, request):
        asked.append(request.offset)
        if cut[0] and len(asked) == 2:
            raise CopyFailed("cut")
        return await real(open_stream, request)

    monkeypatch.setattr(link_files, "_ask_range", counting)
    async with relay_serving(served, tmp_path) as open_stream:
        with pytest.raises(CopyFailed, match="cut"):
            await copy_model(open_stream, "one-file", dest, progress=lambda *p: None)
        assert not dest.exists()
        assert asked[:2] == [0, 1 << 20]  # the second range was cut
        asked.clear()
        cut[0] = False
        seen = []
        await copy_model(
            open_stream, "one-file", dest, progress=lambda *p: seen.append(p)
        )
    assert dest.read_bytes() == served["one-file"].read_bytes()
    assert seen[0] == (1 << 20, ONE_FILE)  # the first range was kept
    assert asked == [1 << 20, 2 << 20]  # only the rest was asked for


async def test_a_copy_that_does_not_check_out_is_thrown_away(served, tmp_path):
    """A staged part whose bytes differ from the peer's fails the SHA-256
    check and is removed: the next copy starts over and is right."""
    dest = tmp_path / "a-models" / "one-file.gguf"
    staging = dest.with_name(".one-file.gguf.copying")
    staging.parent.mkdir(parents=True)
    staging.write_bytes(b"\0" * 1000)  # a corrupt earlier part
    async with relay_serving(served, tmp_path) as open_stream:
        with pytest.raises(CopyFailed, match="SHA-256"):
            await copy_model(open_stream, "one-file", dest, progress=lambda *p: None)
        assert not dest.exists() and not staging.exists()
        await copy_model(open_stream, "one-file", dest, progress=lambda *p: None)
    assert dest.read_bytes() == served["one-file"].read_bytes()


async def test_the_relay_serves_only_catalog_models_and_no_links(served, tmp_path):
    """A model the serving node does not name, one without files, a path out
    of the model, and a symbolic link are refused; the link is not served."""
    async with relay_serving(served, tmp_path) as open_stream:
        for model, message in [("nope", "no model 'nope'"), ("gone", "no files")]:
            with pytest.raises(CopyFailed, match=message):
                await copy_model(
                    open_stream, model, tmp_path / "x", progress=lambda *p: None
                )
        dest = tmp_path / "a-models" / "linked"
        await copy_model(open_stream, "linked", dest, progress=lambda *p: None)
        assert tree(dest) == {"ok.txt": b"ok"}  # escape.txt left out
        for path in ["../secret.txt", "escape.txt"]:
            request = link_files.FileRequest(
                kind="range", model="linked", path=path, offset=0, length=2
            )
            with pytest.raises(CopyFailed):
                await link_files._ask_range(open_stream, request)


def test_manifest_paths_that_leave_the_model_are_refused():
    for bad in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a\\b"]:
        with pytest.raises(ValueError):
            relative_part(bad)
    assert relative_part("sub/weights.bin").parts == ("sub", "weights.bin")


async def test_not_enough_disk_is_refused_before_writing(served, tmp_path, monkeypatch):
    monkeypatch.setattr(link_files, "_free_bytes", lambda directory: 1 << 20)
    dest = tmp_path / "a-models" / "dir-model"
    async with relay_serving(served, tmp_path) as open_stream:
        with pytest.raises(CopyFailed, match="free on"):
            await copy_model(open_stream, "dir-model", dest, progress=lambda *p: None)
    assert not dest.exists()
    assert not dest.with_name(".dir-model.copying").exists()


async def test_a_wrong_secret_copies_nothing(served, tmp_path):
    """A caller whose secret the relay does not know gets no link, so no files
    (control: the other tests' callers, with the secret, copy)."""
    key, cert, fingerprint = relay_certificate(tmp_path / "tls2", "b")
    relay, port = await file_relay(
        served, secret=SECRET, tls=server_tls_context(key, cert)
    )
    pool = LinkPool(node="a", secret="guess")
    peer = Peer(node="b", host="127.0.0.1", port=port, tls_fingerprint=fingerprint)
    try:
        with pytest.raises(LinkRefused, match="wrong secret"):
            await copy_model(
                files_opener(pool, peer), "one-file", tmp_path / "x", progress=print
            )
    finally:
        pool.close()
        await relay.close()
    assert not (tmp_path / "x").exists()
