"""A GGUF model at a plain address, `https://HOST/PATH/NAME.gguf`, with the
SHA-256 its publisher gives: the address checked, the file's size (a HEAD)
and what its header says (read over range requests) before a byte of the
weights is downloaded, and the folder it is kept in.

Every request goes through huggingface_hub's own HTTP session (get_session:
its client, proxies and timeouts), never a hand-written client; the download
itself is pull.pull_file's (http_get, continued with a range request after a
cut, the SHA-256 checked before the one rename). Only https:// is taken,
except http:// to a loopback address (a mirror on this host, the tests): the
SHA-256 guards the bytes either way, but an address on the network should not
be read or rewritten on the way. No token or credential is ever sent."""

import contextlib
import ipaddress
import re
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import httpx2
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import get_session

from engines.backends.ggufmeta import GGUFFormatError, read_header_from

from .hub import GgufFacts, HubError, HubFile

# A pulled address's files go under this folder of the models dir, then its
# host and the folders of its path: `urls--HOST--PATH--TO/NAME.gguf`.
URL_FOLDER = "urls"
SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
# What a model name may hold (catalog.models.MODEL_NAME_VALIDATOR).
NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._:/-]+")


def is_url(source: str) -> bool:
    """Whether the source is an address (http:// or https://), not hf:."""
    return source.lower().startswith(("https://", "http://"))


def url_checked(source: str, sha256: str) -> str:
    """The SHA-256, lower-case, once the address may be pulled; HubError
    (400) for an expected SHA-256 missing or not 64 hex digits, an address
    that is not https:// (http:// only to a loopback address), or one whose
    path does not end in .gguf."""
    if not sha256:
        raise HubError(
            400,
            f"{source}: give the file's expected SHA-256 (--sha256): an "
            "address publishes none, and the download is checked against it",
        )
    if not SHA256.match(sha256):
        raise HubError(400, f"{sha256!r} is not a SHA-256 (64 hexadecimal digits)")
    parts = urlsplit(source)
    if parts.scheme == "http" and not _loopback(parts.hostname or ""):
        raise HubError(
            400,
            f"{source}: only https:// addresses are pulled (http:// only "
            "from this host's loopback)",
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HubError(400, f"{source!r} is not an https:// address")
    name = _file_name(source)
    if "/" in name or "\\" in name or name.startswith("."):
        raise HubError(400, f"{source}: {name!r} is not a file name to keep")
    if not name.lower().endswith(".gguf"):
        raise HubError(
            400,
            f"{source}: an address must name a GGUF file (…/NAME.gguf); "
            "pull transformers repositories from the Hub (hf:ORG/REPO)",
        )
    return sha256.lower()


def url_folder(url: str) -> str:
    """The pull's folder name (a plan's repo_id, `/` becoming `--` on disk):
    URL_FOLDER, the host (its port after `_`) and the path's folders, so that
    two addresses never share a file."""
    parts = urlsplit(url)
    host = (parts.hostname or "") + (f"_{parts.port}" if parts.port else "")
    folders = [
        unquote(p) for p in parts.path.split("/")[:-1] if p not in ("", ".", "..")
    ]
    return "/".join([URL_FOLDER, host, *folders])


def url_name(url: str) -> str:
    """The model's default name: the file's name without .gguf, lower-case."""
    stem = _file_name(url)[: -len(".gguf")]
    return NAME_UNSAFE.sub("-", stem).strip("-._:/").lower() or "model"


def url_file(url: str, sha256: str) -> HubFile:
    """The file at the address (its name, its size from a HEAD, the SHA-256
    it must have); HubError 404 nothing there, 401 refused, 400 no size."""
    with url_errors(url):
        answer = get_session().head(
            url, follow_redirects=True, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT
        )
        _raise_for(url, answer.status_code)
    size = answer.headers.get("Content-Length")
    if not size or not size.isdigit():
        raise HubError(400, f"{url}: the server does not say the file's size")
    return HubFile(name=_file_name(url), size=int(size), sha256=sha256)


def url_facts(url: str, file: HubFile) -> GgufFacts:
    """The file's header, read over range requests (a few MiB of a file of
    GiBs); HubError (400) for a file that is not GGUF, known from its first
    bytes, or a server that does not serve ranges."""
    with url_errors(url):
        try:
            header = read_header_from(
                RangedFile(url, file.size), file.size, name=file.name
            )
        except GGUFFormatError as error:
            raise HubError(400, f"{url}: {error}") from None
    return GgufFacts(file=file, header=header)


class RangedFile:
    """A read-only, seekable file over an address, each `read` one range
    request through huggingface_hub's session (ggufmeta reads whole blocks)."""

    def __init__(self, url: str, size: int) -> None:
        self.url = url
        self.size = size
        self.position = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.position, 2: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, count: int = -1) -> bytes:
        """Up to `count` bytes from the position (to the end when negative)."""
        end = self.size if count < 0 else min(self.size, self.position + count)
        if end <= self.position:
            return b""
        ranged = {"Range": f"bytes={self.position}-{end - 1}"}
        with get_session().stream(
            "GET",
            self.url,
            headers=ranged,
            follow_redirects=True,
            timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
        ) as answer:
            _raise_for(self.url, answer.status_code)
            if answer.status_code != 206:
                raise HubError(
                    400,
                    f"{self.url}: the server does not serve byte ranges (it "
                    f"answered {answer.status_code}), which the header read and "
                    "a resumed download need",
                )
            data = answer.read()
        self.position += len(data)
        return data


def _file_name(url: str) -> str:
    """The file's name: the address's path after its last `/`, unquoted."""
    return unquote(urlsplit(url).path.rsplit("/", 1)[-1])


def _raise_for(url: str, status: int) -> None:
    """HubError for an error answer: 404 nothing there, 401 refused, 502 else."""
    if status == 404:
        raise HubError(404, f"nothing at {url} (404)")
    if status in (401, 403):
        raise HubError(
            401,
            f"{url} refused access ({status}); Roundhouse sends no "
            "credentials to an address: give one that is public",
        )
    if status >= 400:
        raise HubError(502, f"{url} answered {status}: try again later")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def url_errors(url: str) -> Iterator[None]:
    """The client's failures on an address as HubErrors that say what to do."""
    try:
        yield
    except HfHubHTTPError as error:
        response = error.response
        _raise_for(url, response.status_code if response is not None else 502)
        raise HubError(502, f"{url} failed: {error}") from None
    except httpx2.HTTPError as error:  # the transport: cut, timed out, refused
        raise HubError(
            502, f"the connection to {url} failed ({error}): try again"
        ) from None
    except OSError as error:
        raise HubError(502, f"{url} failed: {error}") from None
