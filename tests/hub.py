"""A local stand-in for the Hugging Face Hub that the real `huggingface_hub`
client talks to, for tests on a machine without internet.

It serves the part of the Hub's HTTP API that huggingface_hub 2.4 calls for
`model_info`, `list_repo_tree`/`list_repo_files`, `get_hf_file_metadata` and
`hf_hub_download`. Large files are stored in LFS the way the Hub stores them:
`resolve` answers with a redirect to a content-addressed URL on a second
listener (the CDN), so a resumed download fetches the same bytes even if the
revision moved meanwhile. Faults (a cut connection, a stall until released, a
corrupted byte) can be set per file, and the bytes served per file are
counted, so tests can show what a download fetched."""

import hashlib
import json
import re
import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# The Hub keeps these in LFS by its default .gitattributes; anything this big
# is refused by git on the Hub anyway.
LFS_SUFFIXES = frozenset({".bin", ".gguf", ".safetensors", ".pt", ".onnx", ".h5"})
LFS_MIN_SIZE = 10 * 1024 * 1024

CHUNK_SIZE = 64 * 1024
LAST_MODIFIED = "2026-01-01T00:00:00.000Z"


@dataclass
class Blob:
    """One file's content, and the hashes the Hub reports for it."""

    source: Path | bytes
    lfs: bool
    size: int = field(init=False, default=0)
    sha256: str = field(init=False, default="")
    git_sha1: str = field(init=False, default="")

    def __post_init__(self) -> None:
        sha256 = hashlib.sha256()
        for chunk in self.read(0, None):
            sha256.update(chunk)
            self.size += len(chunk)
        self.sha256 = sha256.hexdigest()
        # Git names a blob by the sha1 of its header and content; for an LFS
        # file the blob in git is the pointer, not the content.
        content = self.pointer if self.lfs else None
        git = hashlib.sha1(usedforsecurity=False)
        git.update(b"blob %d\0" % (len(content) if content else self.size))
        for chunk in [content] if content else self.read(0, None):
            git.update(chunk)
        self.git_sha1 = git.hexdigest()

    @classmethod
    def of(cls, name: str, source: Path | bytes) -> "Blob":
        """A blob for a file named `name`, in LFS if the Hub would put it there."""
        size = len(source) if isinstance(source, bytes) else source.stat().st_size
        lfs = Path(name).suffix in LFS_SUFFIXES or size >= LFS_MIN_SIZE
        return cls(source, lfs)

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer file that git holds in the blob's place."""
        return (
            "version https://git-lfs.github.com/spec/v1\n"
            f"oid sha256:{self.sha256}\nsize {self.size}\n"
        ).encode()

    def read(self, start: int, end: int | None) -> Iterator[bytes]:
        """The bytes from `start` to `end` (exclusive; None: to the end)."""
        if isinstance(self.source, bytes):
            data = self.source[start:end]
            for offset in range(0, len(data), CHUNK_SIZE):
                yield data[offset : offset + CHUNK_SIZE]
            return
        with self.source.open("rb") as file:
            file.seek(start)
            left = None if end is None else end - start
            while left is None or left > 0:
                chunk = file.read(CHUNK_SIZE if left is None else min(CHUNK_SIZE, left))
                if not chunk:
                    return
                if left is not None:
                    left -= len(chunk)
                yield chunk


@dataclass
class Stall:
    """A transfer held mid-body: `reached` is set when the server stops sending,
    and it sends the rest once the test sets `release`."""

    at: int
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class Faults:
    """What the server does wrong while sending one blob."""

    cut_at: int | None = None
    cuts_left: int = 0
    stall: Stall | None = None
    corrupt_at: int | None = None


class HubError(Exception):
    """An error answer, with the headers the client maps to its exceptions."""

    def __init__(self, status: int, code: str | None, message: str, **headers: str):
        super().__init__(message)
        self.status = status
        self.headers = {"X-Error-Message": message, **headers}
        if code:
            self.headers["X-Error-Code"] = code


class LocalHub:
    """A Hub on 127.0.0.1 serving `{"org/name": {"path/in/repo": Path | bytes}}`;
    repos in `gated` need `Authorization: Bearer <hub.token>` for their files."""

    def __init__(
        self,
        repos: Mapping[str, Mapping[str, Path | bytes]],
        *,
        gated: frozenset[str] | set[str] = frozenset(),
        host: str = "127.0.0.1",
    ) -> None:
        self.token = f"hf_local_{secrets.token_hex(8)}"
        self.gated = frozenset(gated)
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.RLock()
        self._commits: dict[str, dict[str, Blob]] = {}
        self._refs: dict[tuple[str, str], str] = {}
        self._repo_of_commit: dict[str, str] = {}
        self._blobs: dict[str, Blob] = {}
        self._served: dict[str, int] = {}
        self._faults: dict[str, Faults] = {}
        for repo_id, files in repos.items():
            self.push(repo_id, files)
        # `host`: another address of this host to listen on (a bridge's, for
        # clients in network namespaces); redirects name it too.
        self._hub = _Server(self, cdn=False, host=host)
        self._cdn = _Server(self, cdn=True, host=host)

    def __enter__(self) -> "LocalHub":
        for server in (self._hub, self._cdn):
            threading.Thread(
                target=server.serve_forever, args=(0.05,), daemon=True
            ).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            for faults in self._faults.values():
                if faults.stall:
                    faults.stall.release.set()
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    @property
    def url(self) -> str:
        """The endpoint to give the client (`endpoint=` or HF_ENDPOINT)."""
        return _url(self._hub)

    @property
    def cdn_url(self) -> str:
        """Where LFS files are served from, by sha256."""
        return _url(self._cdn)

    def file_url(self, repo_id: str, filename: str, revision: str = "main") -> str:
        """A plain http:// address of the file's content on the CDN listener,
        ending in its name (as an https:// source names one), with ranges,
        HEAD, faults and bytes served counted as for the Hub's own downloads."""
        blob = self.blob(repo_id, filename, revision)
        return f"{self.cdn_url}/lfs/{blob.sha256}/{filename.rsplit('/', 1)[-1]}"

    def push(self, repo_id: str, files: Mapping[str, Path | bytes]) -> str:
        """Make `files` a new commit and move `main` to it; its 40-hex sha."""
        blobs = {name: Blob.of(name, source) for name, source in files.items()}
        with self._lock:
            parent = self._refs.get((repo_id, "main"), "")
            digest = hashlib.sha1(usedforsecurity=False)
            digest.update(repo_id.encode() + b"\0" + parent.encode())
            for name, blob in sorted(blobs.items()):
                digest.update(f"{name}\0{blob.git_sha1}\0".encode())
            sha = digest.hexdigest()
            self._commits[sha] = blobs
            self._repo_of_commit[sha] = repo_id
            self._refs[(repo_id, "main")] = sha
            for blob in blobs.values():
                self._blobs.setdefault(blob.sha256, blob)
                self._served.setdefault(blob.sha256, 0)
        return sha

    def commit_sha(self, repo_id: str, revision: str = "main") -> str:
        """The commit that `revision` of `repo_id` points to now."""
        return self._commit(repo_id, revision)[0]

    def blob(self, repo_id: str, filename: str, revision: str = "main") -> Blob:
        """The blob that `filename` is at `revision`."""
        return self._file(repo_id, revision, filename)[1]

    def bytes_served(self, repo_id: str, filename: str, revision: str = "main") -> int:
        """Body bytes sent so far for this file's content, over all requests."""
        with self._lock:
            return self._served[self.blob(repo_id, filename, revision).sha256]

    def cut(
        self, repo_id: str, filename: str, *, fraction: float = 0.4, times: int = 1
    ) -> None:
        """Close the connection once a transfer reaches `fraction` of the file,
        for the next `times` transfers that pass that point."""
        blob = self.blob(repo_id, filename)
        faults = self._faults_of(blob)
        faults.cut_at, faults.cuts_left = int(blob.size * fraction), times

    def stall(self, repo_id: str, filename: str, *, fraction: float = 0.4) -> Stall:
        """Hold the next transfer that reaches `fraction` of the file."""
        blob = self.blob(repo_id, filename)
        stall = Stall(at=int(blob.size * fraction))
        self._faults_of(blob).stall = stall
        return stall

    def corrupt(
        self, repo_id: str, filename: str, *, offset: int | None = None
    ) -> None:
        """Flip the byte at `offset` (default: the middle) in every transfer."""
        blob = self.blob(repo_id, filename)
        self._faults_of(blob).corrupt_at = blob.size // 2 if offset is None else offset

    def _faults_of(self, blob: Blob) -> Faults:
        with self._lock:
            return self._faults.setdefault(blob.sha256, Faults())

    def _commit(self, repo_id: str, revision: str) -> tuple[str, dict[str, Blob]]:
        with self._lock:
            if (repo_id, "main") not in self._refs:
                raise HubError(404, "RepoNotFound", "Repository not found")
            sha = self._refs.get((repo_id, revision), revision)
            if self._repo_of_commit.get(sha) != repo_id:
                raise HubError(404, "RevisionNotFound", "Invalid rev id: " + revision)
            return sha, self._commits[sha]

    def _file(self, repo_id: str, revision: str, filename: str) -> tuple[str, Blob]:
        sha, files = self._commit(repo_id, revision)
        if filename not in files:
            raise HubError(
                404, "EntryNotFound", "Entry not found", **{"X-Repo-Commit": sha}
            )
        return sha, files[filename]


def _url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: LocalHub, *, cdn: bool, host: str) -> None:
        super().__init__((host, 0), _Handler)
        self.hub = hub
        self.cdn = cdn


_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class _Handler(BaseHTTPRequestHandler):
    """Routes: /api/models/{repo}[/revision/{rev}], /api/models/{repo}/tree/{rev}
    and /{repo}/resolve/{rev}/{file} on the hub; /lfs/{sha256}[/{name}] on the CDN."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        with hub._lock:
            hub.requests.append((self.command, url.path, self.headers.get("Range")))
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        try:
            # /lfs/{sha256}, or /lfs/{sha256}/{name}: a plain address that
            # ends in the file's name (file_url), as a model's web page gives.
            if self.server.cdn and parts[:1] == ["lfs"] and len(parts) in (2, 3):
                with hub._lock:
                    blob = hub._blobs.get(parts[1])
                if blob is None:
                    raise HubError(404, None, "Not found")
                self._send_blob(blob, {}, body=body)
            elif self.server.cdn:
                raise HubError(404, None, "Not found")
            elif parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(f"{parts[2]}/{parts[3]}", parts[4:], parse_qs(url.query))
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo_id = f"{parts[0]}/{parts[1]}"
                self._resolve(repo_id, parts[3], "/".join(parts[4:]), body=body)
            else:
                raise HubError(404, None, "Not found")
        except HubError as error:
            self._send_error(error)

    def _api(self, repo_id: str, rest: list[str], query: dict) -> None:
        hub = self.server.hub
        if rest[:1] == ["revision"] and len(rest) == 2:
            self._send_json(self._model_info(repo_id, rest[1]))
        elif not rest:
            self._send_json(self._model_info(repo_id, "main"))
        elif rest[:1] == ["tree"] and len(rest) >= 2:
            _, files = hub._commit(repo_id, rest[1])
            recursive = query.get("recursive", ["False"])[0].lower() == "true"
            self._send_json(_tree(files, "/".join(rest[2:]), recursive=recursive))
        else:
            raise HubError(404, None, "Not found")

    def _model_info(self, repo_id: str, revision: str) -> dict:
        # Metadata of a gated repo is public on the Hub; only its files are not.
        sha, files = self.server.hub._commit(repo_id, revision)
        return {
            "_id": sha[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": sha,
            "lastModified": LAST_MODIFIED,
            "createdAt": LAST_MODIFIED,
            "private": False,
            "gated": "manual" if repo_id in self.server.hub.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [
                {"rfilename": name, **_blob_fields(blob)}
                for name, blob in sorted(files.items())
            ],
            "usedStorage": sum(blob.size for blob in files.values()),
        }

    def _resolve(self, repo_id: str, revision: str, filename: str, *, body: bool):
        hub = self.server.hub
        sha, blob = hub._file(repo_id, revision, filename)
        if repo_id in hub.gated:
            if self.headers.get("Authorization") != f"Bearer {hub.token}":
                message = f"Access to model {repo_id} is restricted."
                raise HubError(401, "GatedRepo", message)
        headers = {"X-Repo-Commit": sha}
        if not blob.lfs:
            self._send_blob(blob, headers, body=body)
            return
        # The Hub redirects LFS files to a CDN by content hash; the client reads
        # the file's etag and size from these headers of the redirect itself.
        headers |= {
            "Location": f"{hub.cdn_url}/lfs/{blob.sha256}",
            "ETag": f'"{blob.sha256}"',
            "X-Linked-Etag": f'"{blob.sha256}"',
            "X-Linked-Size": str(blob.size),
            "Content-Length": "0",
        }
        self._send(302, headers)

    def _send_blob(self, blob: Blob, headers: dict[str, str], *, body: bool):
        start, end, status = 0, blob.size, 200
        if match := _RANGE.fullmatch(self.headers.get("Range") or ""):
            first, last = match.groups()
            if first:
                start = int(first)
                end = min(int(last) + 1, blob.size) if last else blob.size
            elif last:
                start = max(blob.size - int(last), 0)
            if start >= blob.size:
                self._send(416, {"Content-Range": f"bytes */{blob.size}"})
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
        etag = blob.sha256 if blob.lfs else blob.git_sha1
        self._send(
            status,
            {
                "ETag": f'"{etag}"',
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
                "Content-Length": str(end - start),
                **headers,
            },
        )
        if body:
            self._send_body(blob, start, end)

    def _send_body(self, blob: Blob, start: int, end: int) -> None:
        hub = self.server.hub
        faults = hub._faults_of(blob)
        position = start
        for chunk in blob.read(start, end):
            if faults.corrupt_at is not None:
                chunk = _flipped(chunk, faults.corrupt_at - position)
            if stall := _take_stall(hub, faults, position, len(chunk)):
                head, chunk = chunk[: stall.at - position], chunk[stall.at - position :]
                if not self._write(blob, head):
                    return
                position += len(head)
                stall.reached.set()
                stall.release.wait()
            if (cut_at := _take_cut(hub, faults, position + len(chunk))) is not None:
                self._write(blob, chunk[: max(cut_at - position, 0)])
                self.close_connection = True
                return
            if not self._write(blob, chunk):
                return
            position += len(chunk)

    def _write(self, blob: Blob, chunk: bytes) -> bool:
        try:
            self.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return False
        with self.server.hub._lock:
            self.server.hub._served[blob.sha256] += len(chunk)
        return True

    def _send_json(self, value: object) -> None:
        data = json.dumps(value).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
        self._send(200, headers)
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, error: HubError) -> None:
        data = json.dumps({"error": str(error)}).encode()
        headers = {
            "Content-Type": "application/json",
            "Content-Length": str(len(data)),
            **error.headers,
        }
        self._send(error.status, headers)
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()


def _take_stall(hub: LocalHub, faults: Faults, position: int, size: int):
    """The stall set for the bytes from `position` on, taken (it fires once)."""
    with hub._lock:
        stall = faults.stall
        if stall and position <= stall.at < position + size:
            faults.stall = None
            return stall
    return None


def _take_cut(hub: LocalHub, faults: Faults, end: int) -> int | None:
    """Where to cut a transfer that is about to send up to `end`, if it must."""
    with hub._lock:
        if faults.cuts_left > 0 and faults.cut_at is not None and faults.cut_at < end:
            faults.cuts_left -= 1
            return faults.cut_at
    return None


def _flipped(chunk: bytes, index: int) -> bytes:
    """`chunk` with its byte at `index` inverted, if it has one there."""
    if not 0 <= index < len(chunk):
        return chunk
    return chunk[:index] + bytes([chunk[index] ^ 0xFF]) + chunk[index + 1 :]


def _blob_fields(blob: Blob) -> dict:
    fields: dict = {"size": blob.size, "blobId": blob.git_sha1}
    if blob.lfs:
        fields["lfs"] = {
            "sha256": blob.sha256,
            "size": blob.size,
            "pointerSize": len(blob.pointer),
        }
    return fields


def _tree(files: Mapping[str, Blob], under: str, *, recursive: bool) -> list[dict]:
    """The entries of `list_repo_tree`: files, and the folders leading to them."""
    prefix = f"{under}/" if under else ""
    entries: dict[str, dict] = {}
    for name, blob in sorted(files.items()):
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split("/")
        for depth in range(1, len(parts)):
            folder = prefix + "/".join(parts[:depth])
            entries.setdefault(folder, {"type": "directory", "path": folder, "oid": ""})
            if not recursive:
                break
        if recursive or len(parts) == 1:
            entry = {"type": "file", "path": name, "oid": blob.git_sha1}
            entry["size"] = blob.size
            if blob.lfs:
                entry["lfs"] = {
                    "oid": blob.sha256,
                    "size": blob.size,
                    "pointerSize": len(blob.pointer),
                }
            entries[name] = entry
    return list(entries.values())
