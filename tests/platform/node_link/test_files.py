"""Model files copied over a node link (platform/node_link/files.py): a real
relay on loopback serving a model directory and a one-file model, the copying
side over a real link, in pinned TLS as between nodes."""

import contextlib
import os
from pathlib import Path

import pytest
from node_link import files as link_files
from node_link.client import LinkPool, Peer
from node_link.files import (
    CopyFailed,
    copy_model,
    relative_part,
)
from node_link.protocol import LinkRefused

from tests.platform.node_link.file_relay import (
    file_relay,
    files_opener,
    model_paths,
    pinned_relay,
)
from tests.waiting import await_for

SECRET = "files-test-secret"
# The catalog's SHA-256 of each model's files, as the model's first
# inspection recorded them (model_digests), for the fixtures' models; any
# other name has a digest no file has.
CATALOG: dict[str, dict[str, str]] = {}
UNKNOWN = {"": "0" * 64}


def catalog_record(paths: dict[str, Path]) -> None:
    CATALOG.clear()
    CATALOG["nope"] = UNKNOWN
    for name, path in paths.items():
        CATALOG[name] = link_files.model_digests(path) if path.exists() else UNKNOWN


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
    catalog_record(paths)
    return paths


@contextlib.asynccontextmanager
async def relay_serving(
    paths: dict[str, Path],
    tmp_path: Path,
    *,
    files: link_files.FileServer | None = None,
    caller_secret: str = SECRET,
):
    """Node b's relay serving `paths` (through `files`, if given) in pinned
    TLS; yields the files opener of node a, which gives `caller_secret`."""
    relay, peer = await pinned_relay(tmp_path, files or paths, secret=SECRET)
    pool = LinkPool(node="a", secret=caller_secret, plain_tcp=True)
    try:
        yield files_opener(pool, peer)
    finally:
        pool.close()
        await relay.close()


async def copy(open_stream, model: str, dest: Path, *, progress=None) -> None:
    """copy_model of `model` to `dest`, checked against the catalog's digests."""
    await copy_model(
        open_stream,
        model,
        dest,
        digests=CATALOG[model],
        progress=progress or (lambda *p: None),
    )


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
        await copy(
            open_stream,
            "dir-model",
            dest,
            progress=lambda *p: seen.append(p),
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
        await copy(open_stream, "one-file", dest)
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
            await copy(open_stream, "one-file", dest)
        assert not dest.exists()
        assert asked[:2] == [0, 1 << 20]  # the second range was cut
        asked.clear()
        cut[0] = False
        seen = []
        await copy(
            open_stream,
            "one-file",
            dest,
            progress=lambda *p: seen.append(p),
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
            await copy(open_stream, "one-file", dest)
        assert not dest.exists() and not staging.exists()
        await copy(open_stream, "one-file", dest)
    assert dest.read_bytes() == served["one-file"].read_bytes()


async def test_the_relay_serves_only_catalog_models_and_no_links(served, tmp_path):
    """A model the serving node does not name, one without files, a path out
    of the model, and a symbolic link are refused; the link is not served."""
    async with relay_serving(served, tmp_path) as open_stream:
        for model, message in [("nope", "no model 'nope'"), ("gone", "no files")]:
            with pytest.raises(CopyFailed, match=message):
                await copy(open_stream, model, tmp_path / "x")
        dest = tmp_path / "a-models" / "linked"
        await copy(open_stream, "linked", dest)
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
            await copy(open_stream, "dir-model", dest)
    assert not dest.exists()
    assert not dest.with_name(".dir-model.copying").exists()


async def test_a_wrong_secret_copies_nothing(served, tmp_path):
    """A caller whose secret the relay does not know gets no link, so no files
    (control: the other tests' callers, with the secret, copy)."""
    async with relay_serving(served, tmp_path, caller_secret="guess") as open_stream:
        with pytest.raises(LinkRefused, match="link refused"):
            await copy(open_stream, "one-file", tmp_path / "x", progress=print)
    assert not (tmp_path / "x").exists()


async def test_a_link_that_asks_and_does_not_read_holds_a_bounded_memory(tmp_path):
    """A peer that asks for many 8 MiB ranges and reads none: the relay reads
    (and holds) at most HELD_PER_LINK of them at a time, the rest wait their
    turn without their data (control: answered directly, each request read
    its range at once: 18 ranges, 144 MiB held)."""
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(link_files.MAX_RANGE))
    relay, port = await file_relay({"big": source}, secret=SECRET)
    files = relay._files
    answered = []
    real_answer = files.answer

    async def answer(payload):
        answered.append(1)
        return await real_answer(payload)

    files.answer = answer
    pool = LinkPool(node="a", secret=SECRET, plain_tcp=True)
    peer = Peer(node="b", host="127.0.0.1", port=port, tls_fingerprint="")
    asks = link_files.HELD_PER_LINK + link_files.WAITING_PER_LINK
    try:
        link = await pool.link(peer)
        link._writer.transport.pause_reading()  # this peer reads nothing more
        request = link_files.FileRequest(
            kind="range", model="big", length=link_files.MAX_RANGE
        )
        for _ in range(asks):
            link.open(link_files.FILES_STREAM, request.encoded())

        def waiting() -> int:
            return sum(turns.waiting for turns in files._turns.values())

        # Every request is in: being answered, or waiting its turn.
        await await_for(lambda: len(answered) + waiting() == asks, what="requests")
        assert len(answered) == link_files.HELD_PER_LINK
        assert waiting() == link_files.WAITING_PER_LINK
    finally:
        pool.close()
        await relay.close()


@pytest.fixture
def linked_models(tmp_path):
    """Node b's models with symbolic links: `hf`, a Hugging Face cache
    snapshot whose files link to ../../blobs; `inner`, a directory whose
    weights link to a file inside it and which holds a linked directory that
    points out of it; `hf-one`, one file of a snapshot (a link to a blob)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not a model")
    repo = tmp_path / "b-models" / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "blobs" / "1111").write_text('{"a": 1}')
    (repo / "blobs" / "2222").write_bytes(os.urandom(300_000))
    (repo / "blobs" / "3333").write_bytes(os.urandom(1000))
    snapshot = repo / "snapshots" / "abc"
    (snapshot / "config.json").symlink_to("../../blobs/1111")
    (snapshot / "model.safetensors").symlink_to("../../blobs/2222")
    (snapshot / "m.gguf").symlink_to("../../blobs/3333")
    (snapshot / "escape.txt").symlink_to(outside / "secret.txt")
    inner = tmp_path / "b-models" / "inner"
    (inner / "real").mkdir(parents=True)
    (inner / "real" / "weights.bin").write_bytes(os.urandom(5000))
    (inner / "weights.bin").symlink_to("real/weights.bin")
    (inner / "out").symlink_to(outside, target_is_directory=True)
    paths = {"hf": snapshot, "inner": inner, "hf-one": snapshot / "m.gguf"}
    catalog_record(paths)
    return paths


async def test_links_inside_a_model_are_copied_as_their_content(
    linked_models, tmp_path
):
    """A Hugging Face snapshot (files linking to ../../blobs) and a model
    whose weights link inside it copy with the links' content as regular
    files; a link or a linked directory out of the model is left out
    (control: before, links were skipped: the snapshot copied empty)."""
    hf, inner = linked_models["hf"], linked_models["inner"]
    async with relay_serving(linked_models, tmp_path) as open_stream:
        dest = tmp_path / "a-models" / "hf"
        await copy(open_stream, "hf", dest)
        assert tree(dest) == {
            "config.json": b'{"a": 1}',
            "m.gguf": (hf / "m.gguf").read_bytes(),
            "model.safetensors": (hf / "model.safetensors").read_bytes(),
        }
        assert not any(path.is_symlink() for path in dest.iterdir())
        dest = tmp_path / "a-models" / "inner"
        await copy(open_stream, "inner", dest)
        weights = (inner / "real" / "weights.bin").read_bytes()
        assert tree(dest) == {"real/weights.bin": weights, "weights.bin": weights}
        dest = tmp_path / "a-models" / "m.gguf"
        await copy(open_stream, "hf-one", dest)
        assert dest.read_bytes() == (hf / "m.gguf").read_bytes()


async def test_ranges_only_for_the_manifests_files(linked_models, tmp_path):
    """A range of a file through a linked directory out of the model, of a
    link out of it, or of a path the manifest does not list is refused
    (control: the ranges of a listed file are served)."""
    async with relay_serving(linked_models, tmp_path) as open_stream:
        for model, path in [
            ("inner", "out/secret.txt"),
            ("hf", "escape.txt"),
            ("hf", "../../blobs/2222"),
            ("inner", ""),
        ]:
            request = link_files.FileRequest(
                kind="range", model=model, path=path, offset=0, length=2
            )
            with pytest.raises(CopyFailed):
                await link_files._ask_range(open_stream, request)
        request = link_files.FileRequest(
            kind="range", model="hf", path="config.json", offset=0, length=2
        )
        assert await link_files._ask_range(open_stream, request) == b'{"'


class LyingFiles(link_files.FileServer):
    """A peer whose manifest gives the catalog's digests whatever its files
    hold."""

    def __init__(self, model_path, catalog) -> None:
        super().__init__(model_path)
        self._catalog = catalog

    def _manifest(self, root):
        manifest = super()._manifest(root)
        entries = [
            entry.model_copy(update={"sha256": self._catalog[entry.path]})
            for entry in manifest.entries
        ]
        return link_files.Manifest(directory=manifest.directory, entries=entries)


@pytest.mark.parametrize("lies", [False, True])
async def test_a_peer_with_a_tampered_file_fails_the_copy(served, tmp_path, lies):
    """A peer serving a file whose content differs from the catalog's SHA-256
    fails the copy, whether its manifest gives the file's own digest or lies
    with the catalog's; nothing takes the model's place (control: the same
    copy checked against the peer's own manifest, as before, succeeded)."""
    catalog = dict(CATALOG["dir-model"])
    weights = served["dir-model"] / "sub" / "weights.bin"
    weights.write_bytes(b"planted" + weights.read_bytes()[7:])  # same size
    lying = LyingFiles(model_paths(served), catalog) if lies else None
    dest = tmp_path / "a-models" / "dir-model"
    async with relay_serving(served, tmp_path, files=lying) as open_stream:
        with pytest.raises(CopyFailed, match="catalog's SHA-256|does not match"):
            await copy(open_stream, "dir-model", dest)
    assert not dest.exists()
