"""Pull sources besides a repository's GGUF file, through the real
huggingface_hub client against the local hub (tests/hub.py): a
sentence-transformers repository (MiniLM) and a transformers one (a tiny
Llama) pulled as folders with only the files that make the model, their kind
and parameters read before the download; and a GGUF file at a plain address
with its SHA-256: its header read over ranges first, resumed after a cut,
refused and removed when its SHA-256 differs."""

import hashlib
import json
import math
import struct
from pathlib import Path

import pytest
from django.core.management import call_command

from catalog.hub import HubError
from catalog.models import ModelConfig
from catalog.pull import (
    PARTIAL,
    STAGING,
    model_folder,
    pull_files,
    pull_plan,
    pull_record,
)
from tests.conftest import run_python
from tests.hub import LocalHub

pytestmark = pytest.mark.django_db

MIB = 1 << 20
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
LLAMA = "org/tiny-llama"
GGUF_REPO = "org/smol-GGUF"
SMOL = "smol.Q4_1.gguf"
# What pulling MiniLM must fetch: its weights in one format, its config and
# tokenizer files, its Pooling module; no README, no data_config.json.
MINILM_FILES = {
    "1_Pooling/config.json",
    "config.json",
    "config_sentence_transformers.json",
    "model.safetensors",
    "modules.json",
    "sentence_bert_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
}
# Other formats a repository carries besides: never pulled.
OTHER_FORMATS = {
    "onnx/model.onnx": b"onnx" * 4096,
    "openvino/openvino_model.bin": b"openvino" * 4096,
    "pytorch_model.bin": b"torch" * 4096,
    "tf_model.h5": b"tf" * 4096,
    "flax_model.msgpack": b"flax" * 4096,
    "model.Q4_0.gguf.part": b"gguf" * 16,
    "images/diagram.png": b"\x89PNG" * 64,
}


def folder_files(folder: Path) -> dict[str, Path]:
    """Every file under `folder`, by its path relative to it."""
    return {
        str(path.relative_to(folder)): path
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def safetensors_parameters(path: Path) -> dict[str, int]:
    """Parameters by dtype, read from the file's own header (not the client's)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    counts: dict[str, int] = {}
    for name, tensor in header.items():
        if name != "__metadata__":
            counts[tensor["dtype"]] = counts.get(tensor["dtype"], 0) + math.prod(
                tensor["shape"]
            )
    return counts


def hub_files(hub: LocalHub, repo: str) -> dict[str, Path | bytes]:
    """The repository's files at main, as LocalHub takes them."""
    from huggingface_hub import HfApi

    names = HfApi(endpoint=hub.url, token=False).list_repo_files(repo)
    return {name: hub.blob(repo, name).source for name in names}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a chat template, built in a child process (this one
    never imports torch)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    built = run_python(
        "from pathlib import Path\n"
        "from tests.engines.conftest import build_tiny_llama\n"
        f"build_tiny_llama(Path({str(out)!r}))\n",
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    return out


@pytest.fixture
def hub(monkeypatch, settings, tmp_path, tiny_llama_dir):
    bundled = Path(settings.MODELS_DIR)
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    minilm = folder_files(bundled / "all-MiniLM-L6-v2")
    repos = {
        MINILM: {**minilm, **OTHER_FORMATS},
        LLAMA: {**folder_files(tiny_llama_dir), **OTHER_FORMATS},
        GGUF_REPO: {
            SMOL: bundled / "SmolLM2-135M-Instruct.Q4_1.gguf",
            "notes.gguf": b"these are notes, not a model\n" * (4 * MIB // 29),
        },
    }
    with LocalHub(repos) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


# -- transformers and sentence-transformers repositories --------------------------


def test_a_sentence_transformers_repository_is_planned_before_its_weights(hub):
    """Its kind, files and parameter count come from its small files and its
    safetensors header: the weights themselves are not fetched yet."""
    # Its default name is the repository's, which the bundled copy holds.
    with pytest.raises(HubError, match="a model named all-minilm-l6-v2 exists"):
        pull_plan(f"hf:{MINILM}")
    plan = pull_plan(f"hf:{MINILM}", name="minilm")
    assert (plan.format, plan.task) == ("embedding", "embedding")
    assert {f.name for f in plan.files} == MINILM_FILES
    assert (plan.model_file, plan.architecture, plan.context_length) == (
        "",
        "bert",
        512,
    )
    weights = hub.blob(MINILM, "model.safetensors")
    real = safetensors_parameters(Path(weights.source))
    # MiniLM-L6's 22.7 M weights, and its position ids (a buffer, int64).
    assert plan.parameters == real == {"F32": 22_713_216, "I64": 512}
    assert plan.needs_mib == pytest.approx((22_713_216 * 4 + 512 * 8) / MIB)
    # Only the header of the weights was read (a ranged read of 100 kB).
    assert hub.bytes_served(MINILM, "model.safetensors") <= 100_001


def test_pulled_folders_are_their_files_alone_and_a_real_engine_serves_them(
    hub, settings, tmp_path
):
    """Each model's folder holds exactly its allowed files (the other formats
    in the repository are served no byte: control, they are there to be
    served), its row points at the folder, and a real engine loads both from
    there: the pulled MiniLM embeds as the bundled copy does, the tiny Llama
    answers a chat."""
    from engines.wire.requests import GenerateRequest
    from tests.engines.conftest import embedder_spec, start_engine
    from tests.engines.generating import transformers_spec

    models_dir = Path(settings.MODELS_DIR)
    pulled = {}
    for repo, name in ((MINILM, "pulled-minilm"), (LLAMA, "pulled-llama")):
        plan = pull_plan(f"hf:{repo}", name=name)
        path = pull_files(plan, models_dir, margin_bytes=0)
        assert path == model_folder(models_dir, repo)
        assert set(folder_files(path)) == {f.name for f in plan.files}
        for other in OTHER_FORMATS:
            assert hub.blob(repo, other).size > 0  # control: the repository has it
            assert hub.bytes_served(repo, other) == 0
        pulled[name] = pull_record(plan, path)
    assert set(folder_files(pulled["pulled-minilm"].resolved_path)) == MINILM_FILES
    assert [(m.format, m.task, m.path) for m in pulled.values()] == [
        ("embedding", "embedding", "sentence-transformers--all-MiniLM-L6-v2"),
        ("transformers", "chat", "org--tiny-llama"),
    ]
    bundled = Path(hub.blob(MINILM, "model.safetensors").source).parent
    engine = start_engine(
        tmp_path / "engine",
        models=[
            embedder_spec(name="bundled", path=str(bundled)),
            embedder_spec(
                name="pulled-minilm", path=str(pulled["pulled-minilm"].resolved_path)
            ),
            transformers_spec(
                "pulled-llama", pulled["pulled-llama"].resolved_path, task="chat"
            ),
        ],
        preload=["bundled", "pulled-minilm", "pulled-llama"],
    )
    try:
        client = engine.client()
        texts = ["a pulled model embeds", "as the bundled one does"]
        rows = client.embed("pulled-minilm", texts)
        reference = client.embed("bundled", texts)
        answer = client.generate(
            GenerateRequest(
                model="pulled-llama",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
                temperature=0,
            )
        )
    finally:
        engine.stop()
    assert rows.shape == (2, 384) and abs(rows - reference).max() < 1e-5
    assert answer.usage.completion_tokens > 0


def test_a_transformers_repository_is_chat_when_it_carries_a_chat_template(
    hub, tiny_llama_dir
):
    """A tiny Llama: transformers, chat (its template), its trained context
    and parameters from its files; without its template: completion."""
    plan = pull_plan(f"hf:{LLAMA}")
    assert (plan.format, plan.task, plan.architecture, plan.context_length) == (
        "transformers",
        "chat",
        "llama",
        512,
    )
    assert {f.name for f in plan.files} == set(folder_files(tiny_llama_dir))
    real = safetensors_parameters(tiny_llama_dir / "model.safetensors")
    assert plan.parameters == real and plan.needs_mib > 0
    # Control: the same model without a chat template is for completion.
    files = {
        name: path
        for name, path in folder_files(tiny_llama_dir).items()
        if name != "chat_template.jinja"
    }
    config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    files["tokenizer_config.json"] = json.dumps(config).encode()
    hub.push(LLAMA, files)
    assert pull_plan(f"hf:{LLAMA}", name="plain").task == "completion"


def test_without_safetensors_the_pytorch_weights_are_pulled(hub):
    """Its .bin weights (and no other format) make the model; with no header
    to read, their size is its need (control: with safetensors, above, the
    .bin is left out)."""
    files = {
        name: source
        for name, source in hub_files(hub, MINILM).items()
        if name != "model.safetensors"
    }
    hub.push(MINILM, files)
    plan = pull_plan(f"hf:{MINILM}", name="minilm-bin")
    names = {f.name for f in plan.files}
    assert names == MINILM_FILES - {"model.safetensors"} | {"pytorch_model.bin"}
    assert plan.parameters == {}
    assert plan.needs_mib == len(OTHER_FORMATS["pytorch_model.bin"]) / MIB


def test_a_repository_with_no_model_says_what_it_lacks(hub):
    """Control: the same pull of a repository with weights plans."""
    hub.push("org/empty", {"README.md": b"hi\n", "onnx/model.onnx": b"x" * 100})
    with pytest.raises(HubError) as refused:
        pull_plan("hf:org/empty")
    assert refused.value.status == 400 and "no GGUF file, nor a config.json" in (
        refused.value.message
    )
    assert pull_plan(f"hf:{MINILM}", name="minilm").files


def test_sharded_weights_are_counted_over_every_shard(tiny_llama_dir, tmp_path):
    """The tiny Llama saved in shards (with their index): every shard and
    the index are pulled, and the parameters are the unsharded model's."""
    sharded = tmp_path / "sharded"
    saved = run_python(
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tiny_llama_dir)!r})\n"
        f"model.save_pretrained({str(sharded)!r}, max_shard_size='100KB')\n",
        env={"HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert saved.returncode == 0, saved.stderr
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1  # control: it is sharded
    files = {
        **{
            n: p
            for n, p in folder_files(tiny_llama_dir).items()
            if "safetensors" not in n
        },
        **folder_files(sharded),
    }
    with LocalHub({LLAMA: files}) as local:
        plan = pull_plan(f"hf:{LLAMA}", endpoint=local.url, token=False)
    assert {*shards, "model.safetensors.index.json"} <= {f.name for f in plan.files}
    assert "model.safetensors" not in {f.name for f in plan.files}
    assert plan.parameters == safetensors_parameters(
        tiny_llama_dir / "model.safetensors"
    )


def test_a_gated_repository_needs_a_token_for_its_small_files_too(tiny_llama_dir):
    """Its config is refused without the token (401, naming HF_TOKEN);
    control: with the token it plans."""
    files = folder_files(tiny_llama_dir)
    with LocalHub({LLAMA: files}, gated={LLAMA}) as gated:
        with pytest.raises(HubError) as refused:
            pull_plan(f"hf:{LLAMA}", endpoint=gated.url, token=False)
        assert refused.value.status == 401 and "HF_TOKEN" in refused.value.message
        plan = pull_plan(f"hf:{LLAMA}", endpoint=gated.url, token=gated.token)
        assert plan.task == "chat" and plan.parameters


# -- a GGUF file at a plain address, with its SHA-256 ------------------------------


def staged(models_dir: Path, plan) -> Path:
    """Where the download in progress is kept."""
    return model_folder(models_dir / STAGING, plan.repo_id) / (SMOL + PARTIAL)


def test_an_address_is_planned_from_its_header_then_pulled(hub, settings):
    url = hub.file_url(GGUF_REPO, SMOL)
    blob = hub.blob(GGUF_REPO, SMOL)
    plan = pull_plan(url, sha256=blob.sha256.upper())
    assert (plan.format, plan.task, plan.architecture, plan.context_length) == (
        "gguf",
        "chat",
        "llama",
        8192,
    )
    assert plan.url == url and plan.name == "smol.q4_1" and plan.size == blob.size
    assert plan.needs_mib > blob.size / MIB
    assert hub.bytes_served(GGUF_REPO, SMOL) < 4 * MIB  # the header only
    models_dir = Path(settings.MODELS_DIR)
    path = pull_files(plan, models_dir, margin_bytes=0)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == blob.sha256
    assert path.parent.name.startswith("urls--127.0.0.1_")
    model = pull_record(plan, path)
    assert model.path == f"{path.parent.name}/{SMOL}" and model.task == "chat"
    # Pulled again: the file in place is reused, nothing fetched.
    served = hub.bytes_served(GGUF_REPO, SMOL)
    assert pull_files(plan, models_dir, margin_bytes=0) == path
    assert hub.bytes_served(GGUF_REPO, SMOL) == served


@pytest.mark.parametrize(
    ("source", "sha256", "says"),
    [
        ("https://example.com/m/model.gguf", "", "give the file's expected SHA-256"),
        ("https://example.com/m/model.gguf", "abc", "is not a SHA-256"),
        ("https://example.com/m/model.gguf", "g" * 64, "is not a SHA-256"),
        ("http://example.com/m/model.gguf", "a" * 64, "only https:// addresses"),
        ("https://example.com/m/model.bin", "a" * 64, "must name a GGUF file"),
        ("https://example.com/m/..%2F..%2Fx.gguf", "a" * 64, "not a file name"),
    ],
)
def test_a_bad_address_is_refused_before_a_request(hub, source, sha256, says):
    """Refused by its form: example.com is never asked (this host cannot
    reach it; a request would fail with 502, not 400)."""
    with pytest.raises(HubError) as refused:
        pull_plan(source, sha256=sha256)
    assert refused.value.status == 400 and says in refused.value.message


def test_an_address_that_is_not_gguf_is_refused_from_its_first_bytes(hub):
    url = hub.file_url(GGUF_REPO, "notes.gguf")
    with pytest.raises(HubError) as refused:
        pull_plan(url, sha256="a" * 64)
    assert refused.value.status == 400 and "GGUF" in refused.value.message
    assert hub.bytes_served(GGUF_REPO, "notes.gguf") <= MIB  # its first block


def test_an_address_missing_is_404(hub):
    url = hub.file_url(GGUF_REPO, SMOL).replace("/lfs/", "/lfs/0")
    with pytest.raises(HubError) as missing:
        pull_plan(url, sha256="a" * 64)
    assert missing.value.status == 404 and "nothing at" in missing.value.message


def test_a_cut_address_pull_resumes_with_only_the_rest(hub, settings):
    """The connection cut at 40% on every try: the pull fails and keeps what
    it had; the next fetches only the rest (control: with the partial file
    removed, all of it)."""
    blob = hub.blob(GGUF_REPO, SMOL)
    plan = pull_plan(hub.file_url(GGUF_REPO, SMOL), sha256=blob.sha256)
    models_dir = Path(settings.MODELS_DIR)
    hub.cut(GGUF_REPO, SMOL, fraction=0.4, times=100)
    with pytest.raises(HubError) as cut:
        pull_files(plan, models_dir, margin_bytes=0)
    assert cut.value.status == 502
    kept = staged(models_dir, plan).stat().st_size
    assert 0 < kept < blob.size
    hub.cut(GGUF_REPO, SMOL, fraction=0.4, times=0)
    before = hub.bytes_served(GGUF_REPO, SMOL)
    path = pull_files(plan, models_dir, margin_bytes=0)
    assert hub.bytes_served(GGUF_REPO, SMOL) - before == blob.size - kept
    assert hashlib.sha256(path.read_bytes()).hexdigest() == blob.sha256
    # Control: without the partial file the same pull fetches it all again.
    path.unlink()
    before = hub.bytes_served(GGUF_REPO, SMOL)
    pull_files(plan, models_dir, margin_bytes=0)
    assert hub.bytes_served(GGUF_REPO, SMOL) - before == blob.size


def test_a_wrong_sha256_is_refused_and_removed(hub, settings):
    """Control: the right SHA-256 pulls it (test above)."""
    plan = pull_plan(hub.file_url(GGUF_REPO, SMOL), sha256="0" * 64)
    models_dir = Path(settings.MODELS_DIR)
    with pytest.raises(HubError) as refused:
        pull_files(plan, models_dir, margin_bytes=0)
    assert refused.value.status == 502 and "SHA-256" in refused.value.message
    assert not plan.path(models_dir).exists()
    assert not staged(models_dir, plan).exists()


def test_the_pull_command_takes_an_address_with_its_sha256(hub, capsys):
    url = hub.file_url(GGUF_REPO, SMOL)
    call_command("pull", url, "--sha256", hub.blob(GGUF_REPO, SMOL).sha256)
    model = ModelConfig.objects.get(name="smol.q4_1")
    assert (model.format, model.task) == ("gguf", "chat")
    assert "added model smol.q4_1" in capsys.readouterr().out


@pytest.mark.django_db(transaction=True)
def test_pull_jobs_run_an_address_and_a_folder_to_their_models(hub, settings):
    """The plans round-trip through the pull's row (its url, its parameters)
    and a worker's run pulls them like a Hub GGUF file."""
    from catalog.models import ModelPull, PullStatus
    from catalog.pull_jobs import pull_run, pull_start

    blob = hub.blob(GGUF_REPO, SMOL)
    by_url = pull_start(
        source=hub.file_url(GGUF_REPO, SMOL), sha256=blob.sha256, name="by-url"
    )
    folder = pull_start(source=f"hf:{MINILM}", name="by-folder")
    assert by_url.plan["url"] and folder.plan["parameters"]["F32"] == 22_713_216
    assert pull_run(by_url.pk) == PullStatus.DONE
    assert pull_run(folder.pk) == PullStatus.DONE
    assert ModelPull.objects.get(pk=folder.pk).done_bytes == folder.size_bytes
    models = {m.name: m for m in ModelConfig.objects.filter(name__startswith="by-")}
    assert models["by-url"].path.endswith(f"/{SMOL}")
    assert (models["by-folder"].format, models["by-folder"].path) == (
        "embedding",
        "sentence-transformers--all-MiniLM-L6-v2",
    )
    assert set(folder_files(Path(settings.MODELS_DIR) / models["by-folder"].path)) == (
        MINILM_FILES
    )
