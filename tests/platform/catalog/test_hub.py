"""A model on the Hub before its download (catalog/hub.py), through the real
huggingface_hub client against the local hub (tests/hub.py): the files at a
pinned commit, a GGUF file picked by quantization, its vision projector, and
its facts and fit read from its header over range requests."""

from pathlib import Path

import pytest
from django.conf import settings

from catalog.hub import HubError, gguf_facts, hub_repo
from engines.backends.ggufmeta import read_header
from engines.backends.memory import gguf_estimate_mib
from tests.hub import LocalHub

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "org/smol-gguf"


@pytest.fixture
def smol() -> Path:
    return Path(settings.MODELS_DIR) / SMOL


@pytest.fixture
def hub(smol):
    repos = {
        REPO: {
            "smol.Q4_1.gguf": smol,
            "smol.Q8_0.gguf": smol,
            "mmproj-smol-f16.gguf": smol,
            "README.md": b"# smol\n",
        },
        "org/not-gguf": {"weights.gguf": b"PK\x03\x04" + bytes(3 << 20)},
    }
    with LocalHub(repos) as local:
        yield local


def test_a_repository_is_read_at_a_pinned_commit(hub, smol):
    """Its files with sizes and the Hub's SHA-256; the revision resolved to
    its commit, which stays the repository's view when `main` moves on."""
    repo = hub_repo(REPO, endpoint=hub.url, token=False)
    assert repo.commit == hub.commit_sha(REPO)
    sizes = {f.name: f.size for f in repo.files}
    assert sizes["smol.Q4_1.gguf"] == smol.stat().st_size
    assert sizes["README.md"] == 7
    [q4] = [f for f in repo.files if f.name == "smol.Q4_1.gguf"]
    assert q4.sha256 == hub.blob(REPO, "smol.Q4_1.gguf").sha256
    hub.push(REPO, {"README.md": b"moved on\n"})
    assert hub_repo(REPO, endpoint=hub.url, token=False).commit != repo.commit
    assert hub_repo(REPO, repo.commit, endpoint=hub.url, token=False) == repo


def test_a_gguf_file_is_picked_by_quantization_and_its_projector_found(hub):
    repo = hub_repo(REPO, endpoint=hub.url, token=False)
    assert [f.quantization for f in repo.gguf_files()] == ["Q4_1", "Q8_0"]
    assert repo.gguf_file("q4_1").name == "smol.Q4_1.gguf"
    assert repo.gguf_file("smol.Q8_0.gguf").quantization == "Q8_0"
    assert repo.projector().name == "mmproj-smol-f16.gguf"
    with pytest.raises(HubError) as missing:
        repo.gguf_file("Q4_K_M")
    assert missing.value.status == 404
    assert "its GGUF files: Q4_1, Q8_0" in missing.value.message


def test_the_facts_and_fit_come_from_the_header_alone(hub, smol):
    """Architecture, trained context, the chat template (so: a chat model)
    and the memory it needs, equal to what the file on disk gives; a few MiB
    of the file fetched, not its weights."""
    repo = hub_repo(REPO, endpoint=hub.url, token=False)
    file = repo.gguf_file("Q4_1")
    facts = gguf_facts(repo, file, endpoint=hub.url, token=False)
    local = read_header(smol)
    assert facts.header == local
    assert facts.architecture == "llama" and facts.task == "chat"
    assert facts.context_length == 8192
    assert facts.needs_mib(context=512, slots=4) == gguf_estimate_mib(
        local, smol.stat().st_size, context=512, slots=4
    )
    served = hub.bytes_served(REPO, "smol.Q4_1.gguf")
    assert 0 < served <= 4 * (1 << 20) < file.size // 10


def test_a_file_that_is_not_gguf_is_refused_from_its_first_bytes(hub):
    repo = hub_repo("org/not-gguf", endpoint=hub.url, token=False)
    [file] = repo.gguf_files()
    with pytest.raises(HubError) as refused:
        gguf_facts(repo, file, endpoint=hub.url, token=False)
    assert refused.value.status == 400
    assert "not a GGUF file" in refused.value.message
    assert hub.bytes_served("org/not-gguf", "weights.gguf") <= 2 * (1 << 20)


def test_the_hubs_refusals_say_what_to_do(smol):
    """Unknown repository and revision: 404; a gated file without a token:
    401 naming HF_TOKEN, and with the hub's token it is read (control)."""
    with LocalHub({"org/gated": {"smol.Q4_1.gguf": smol}}, gated={"org/gated"}) as hub:
        with pytest.raises(HubError) as unknown:
            hub_repo("org/nothing", endpoint=hub.url, token=False)
        assert unknown.value.status == 404
        with pytest.raises(HubError) as revision:
            hub_repo("org/gated", "v9", endpoint=hub.url, token=False)
        assert revision.value.status == 404
        assert "no revision v9" in revision.value.message
        # A gated repository's metadata is public; its files are not.
        repo = hub_repo("org/gated", endpoint=hub.url, token=False)
        file = repo.gguf_file("Q4_1")
        with pytest.raises(HubError) as gated:
            gguf_facts(repo, file, endpoint=hub.url, token=False)
        assert gated.value.status == 401 and "HF_TOKEN" in gated.value.message
        facts = gguf_facts(repo, file, endpoint=hub.url, token=hub.token)
        assert facts.task == "chat"


def test_the_token_comes_from_the_environment_or_a_private_file(
    tmp_path, monkeypatch, smol
):
    """HF_TOKEN first; else the run dir's 0600 file, which a gated file is then
    read with; a token file others may read is refused (control: the same
    file at 0600 is used); none at all is False, never the client's own."""
    from catalog.hub import TOKEN_FILE, hub_token

    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert hub_token(tmp_path) is False
    path = tmp_path / TOKEN_FILE
    with LocalHub({"org/gated": {"smol.Q4_1.gguf": smol}}, gated={"org/gated"}) as hub:
        path.write_text(hub.token + "\n")
        path.chmod(0o644)
        with pytest.raises(HubError) as shared:
            hub_token(tmp_path)
        assert shared.value.status == 500 and "chmod 600" in shared.value.message
        path.chmod(0o600)
        assert hub_token(tmp_path) == hub.token
        monkeypatch.setattr(settings, "RUN_DIR", tmp_path)
        repo = hub_repo("org/gated", endpoint=hub.url)
        assert gguf_facts(repo, repo.gguf_file("Q4_1"), endpoint=hub.url).task == "chat"
        monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
        assert hub_token(tmp_path) == "hf_from_the_environment"
