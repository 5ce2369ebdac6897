"""A model on the Hugging Face Hub before a byte of its weights is downloaded:
the repository's files at a revision pinned to its commit (sizes, and the
SHA-256 the Hub publishes for each large file), each GGUF file's quantization
and vision projector, and what a GGUF file is and needs, read from its header
over range requests.

Everything goes through huggingface_hub (HfApi for the repository,
HfFileSystem's ranged file for the header, its session and URLs for a small
file: hub_file_bytes): no hand-written HTTP. A repository without GGUF files
(transformers, sentence-transformers) is read by hub_folders.py. The Hub's
address is HF_ENDPOINT's (a mirror; `hub_endpoint`) unless `endpoint` is given;
a gated repository needs a token: `hub_token`'s (HF_TOKEN, else a 0600 file
in the run dir; never the database, a log or the client's own stored token)
unless `token` is given. Its failures come out as HubError, with the status
to answer and a message that says what to do."""

import contextlib
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from django.conf import settings
from huggingface_hub import (
    HfApi,
    HfFileSystem,
    constants,
    get_hf_file_metadata,
    hf_hub_url,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from engines.backends.ggufmeta import GGUFFormatError, GGUFHeader, read_header_from
from engines.backends.memory import gguf_estimate_mib, gguf_shape

# A quantization as GGUF file names spell it: Q4_K_M, Q8_0, IQ4_XS, F16, BF16.
QUANTIZATION = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Za-z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# A vision model's projector, pulled beside its GGUF model (llama.cpp's name).
PROJECTOR = re.compile(r"(^|/)mmproj[^/]*\.gguf$", re.IGNORECASE)
# A token for gated repositories, when HF_TOKEN is unset: this file in the run
# dir, readable by its owner alone (mode 0600, as the secret key is kept).
TOKEN_FILE = "hf_token"  # noqa: S105 - a file name, not a secret
# What HfFileSystem reads ahead per range request: a header's blocks, not
# the weights behind them.
HEADER_BLOCK = 1 << 20


class HubError(Exception):
    """The Hub could not give what was asked, and why: `status` is the HTTP
    status to answer with (404 unknown, 401 gated, 400 not a model, 502 the
    Hub failed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class HubFile:
    """One file of a repository at its commit."""

    name: str
    size: int
    sha256: str = ""  # the Hub's, for a large (LFS) file; "" for a small one

    @property
    def quantization(self) -> str:
        """Its quantization as its name spells it ("" when it says none)."""
        found = QUANTIZATION.findall(self.name.rsplit("/", 1)[-1].removesuffix(".gguf"))
        return found[-1].upper() if found else ""


@dataclass(frozen=True)
class HubRepo:
    """A repository at one commit: the revision asked for, resolved once, so
    that every later read and the download see the same files."""

    repo_id: str
    commit: str
    files: tuple[HubFile, ...]

    def gguf_files(self) -> list[HubFile]:
        """Its GGUF models (a projector is not one), by name."""
        return sorted(
            (f for f in self.files if f.name.endswith(".gguf") and not _projector(f)),
            key=lambda f: f.name,
        )

    def projector(self) -> HubFile | None:
        """Its vision projector (`mmproj*.gguf`), if it carries one."""
        return next((f for f in self.files if _projector(f)), None)

    def gguf_file(self, wanted: str = "") -> HubFile:
        """The GGUF model named by a quantization (`Q4_K_M`, any case) or by
        its file name, or with neither its only one; HubError (404) naming
        those it has, else."""
        models = self.gguf_files()
        chosen = [f for f in models if f.name == wanted] or [
            f for f in models if f.quantization == wanted.upper() or not wanted
        ]
        if len(chosen) == 1:
            return chosen[0]
        offered = ", ".join(f.quantization or f.name for f in models) or "none"
        if not wanted:
            raise HubError(
                404, f"{self.repo_id}: say which GGUF file (its files: {offered})"
            )
        if chosen:
            names = ", ".join(f.name for f in chosen)
            raise HubError(
                404, f"{wanted} names several files of {self.repo_id}: {names}"
            )
        raise HubError(
            404, f"{self.repo_id} has no GGUF file {wanted}; its GGUF files: {offered}"
        )


@dataclass(frozen=True)
class GgufFacts:
    """What a GGUF file's header says, and what serving it needs."""

    file: HubFile
    header: GGUFHeader

    @property
    def architecture(self) -> str:
        return str(self.header.get("general.architecture", ""))

    @property
    def context_length(self) -> int:
        return int(gguf_shape(self.header)["trained_context"])

    @property
    def chat_template(self) -> str:
        return str(self.header.get("tokenizer.chat_template") or "")

    @property
    def task(self) -> str:
        """chat when it carries a chat template, else completion."""
        return "chat" if self.chat_template else "completion"

    def needs_mib(self, *, context: int = 0, slots: int = 1) -> float:
        """Its memory served by llama.cpp: the estimate residency uses."""
        return gguf_estimate_mib(
            self.header, self.file.size, context=context, slots=slots
        )


def hub_endpoint(endpoint: str | None = None) -> str | None:
    """The Hub's address: `endpoint`, else HF_ENDPOINT as it is now (a
    mirror; read at each call, not once at import as the client does), else
    None (the client's default, huggingface.co)."""
    return endpoint or os.environ.get("HF_ENDPOINT") or None


def hub_token(run_dir: Path | None = None) -> str | bool:
    """The token for gated repositories: HF_TOKEN, else the run dir's
    TOKEN_FILE; False when there is none (so the client does not send one it
    stored itself). HubError (500) for a token file others may read: it is
    refused, not used."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    path = Path(run_dir or settings.RUN_DIR) / TOKEN_FILE
    try:
        info = path.stat()
    except FileNotFoundError:
        return False
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise HubError(
            500,
            f"{path} may be read by others (mode {stat.S_IMODE(info.st_mode):o}): "
            f"`chmod 600 {path}`, then try again",
        )
    return path.read_text(encoding="utf-8").strip() or False


def hub_repo(
    repo_id: str,
    revision: str = "main",
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> HubRepo:
    """The repository's files at `revision`, pinned to the commit it names now."""
    api = HfApi(
        endpoint=hub_endpoint(endpoint), token=hub_token() if token is None else token
    )
    with hub_errors(repo_id, revision):
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    files = tuple(
        HubFile(
            name=sibling.rfilename,
            size=int(sibling.size or 0),
            sha256=sibling.lfs.sha256 if sibling.lfs else "",
        )
        for sibling in info.siblings or ()
    )
    return HubRepo(repo_id=repo_id, commit=str(info.sha), files=files)


def hub_search(query: str, *, gguf: bool, limit: int = 20) -> list[tuple[str, int]]:
    """Repositories whose name holds `query`, the most downloaded first (GGUF
    ones only when `gguf`): each one's id and downloads. HubError when the
    Hub fails."""
    api = HfApi(endpoint=hub_endpoint(), token=hub_token())
    with hub_errors(query, "main"):
        found = api.list_models(
            search=query,
            filter="gguf" if gguf else None,
            sort="downloads",
            limit=limit,
        )
        return [(model.id, model.downloads or 0) for model in found]


def gguf_facts(
    repo: HubRepo,
    file: HubFile,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> GgufFacts:
    """The file's header, read at the repository's commit over range
    requests (a few MiB of a file of GiBs); HubError (400) for a file that
    is not GGUF, known from its first bytes."""
    if token is None:
        token = hub_token()
    files = HfFileSystem(
        endpoint=hub_endpoint(endpoint), token=token, skip_instance_cache=True
    )
    path = f"{repo.repo_id}/{file.name}"
    with hub_errors(repo.repo_id, repo.commit):
        with files.open(
            path, "rb", revision=repo.commit, block_size=HEADER_BLOCK
        ) as handle:
            try:
                header = read_header_from(handle, file.size, name=file.name)
            except GGUFFormatError as error:
                raise HubError(400, f"{path}: {error}") from None
    return GgufFacts(file=file, header=header)


def hub_file_bytes(
    repo: HubRepo,
    name: str,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> bytes:
    """A small file of the repository at its commit (a config.json, a
    tokenizer's config), read whole through the client's session, URL and
    headers; HubError (404) when it has none of that name."""
    endpoint = hub_endpoint(endpoint)
    token = hub_token() if token is None else token
    url = hf_hub_url(repo.repo_id, name, revision=repo.commit, endpoint=endpoint)
    with hub_errors(repo.repo_id, repo.commit):
        answer = get_session().get(
            url,
            headers=build_hf_headers(token=token),
            timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
        )
        hf_raise_for_status(answer)
    return answer.content


def hub_download_location(
    repo: HubRepo,
    file: HubFile,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> tuple[str, dict]:
    """Where the client downloads the file from at the repository's commit
    (a CDN's signed address for a large file), and the headers to send
    there (the token only to the Hub itself)."""
    token = hub_token() if token is None else token
    endpoint = hub_endpoint(endpoint)
    url = hf_hub_url(repo.repo_id, file.name, revision=repo.commit, endpoint=endpoint)
    location = get_hf_file_metadata(url, token=token, endpoint=endpoint).location
    headers = build_hf_headers(token=token)
    if urlsplit(location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a CDN's signed address: no token
    return location, headers


def _projector(file: HubFile) -> bool:
    return bool(PROJECTOR.search(file.name))


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str) -> Iterator[None]:
    """The client's failures as HubErrors that say what to do."""
    try:
        yield
    except GatedRepoError:  # before its base class, RepositoryNotFoundError
        raise HubError(
            401,
            f"{repo_id} is gated: accept its terms on the Hub, then give "
            "Roundhouse a token (HF_TOKEN)",
        ) from None
    except RepositoryNotFoundError:
        raise HubError(404, f"no repository {repo_id} on the Hub") from None
    except RevisionNotFoundError:
        raise HubError(404, f"{repo_id} has no revision {revision}") from None
    except (EntryNotFoundError, FileNotFoundError) as error:
        raise HubError(404, f"{repo_id} has no such file: {error}") from None
    except (HfHubHTTPError, OSError) as error:
        raise HubError(502, f"the Hub failed: {error}") from None
    except httpx2.HTTPError as error:  # the client's transport: cut, timed out
        raise HubError(
            502, f"the connection to the Hub failed ({error}): try again"
        ) from None
