"""A transformers or sentence-transformers repository on the Hub, before a byte
of its weights is downloaded: which of its files make the model, what the
model is, and what it needs.

The files: its weights in one format (safetensors when it has them, else
pytorch_model*.bin), its config, tokenizer and generation files and, for a
sentence-transformers model, the module folders its modules.json names
(1_Pooling/, 2_Dense/ ...); never the onnx/, openvino/, flax, tf, GGUF or
other copies a repository often carries besides, nor a README's images.
What it is: an embedding model when it is a sentence-transformers one
(modules.json, sentence_bert_config.json or config_sentence_transformers.json);
else a transformers model for chat when its tokenizer carries a chat template
(tokenizer_config.json's chat_template, chat_template.jinja or
chat_template.json), for completion otherwise. Its parameters by dtype come
from the safetensors headers, read over range requests by huggingface_hub's
own HfApi.get_safetensors_metadata; its memory need follows from them as
engines.backends.memory.estimate_model_mib counts it once on disk."""

import json
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from huggingface_hub import HfApi
from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

from engines.backends.memory import MIB, transformers_estimate_mib

from .hub import (
    HubError,
    HubFile,
    HubRepo,
    hub_endpoint,
    hub_errors,
    hub_file_bytes,
    hub_token,
)

CONFIG = "config.json"
MODULES = "modules.json"
# Any of these makes a repository a sentence-transformers model.
SENTENCE_TRANSFORMERS = (
    MODULES,
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# The files besides the weights that loading a model (or a module) reads.
SIDE_FILES = frozenset(
    {
        CONFIG,
        "generation_config.json",
        "tokenizer.json",
        TOKENIZER_CONFIG,
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.txt",
        "vocab.json",
        "merges.txt",
        "spiece.model",
        "sentencepiece.bpe.model",
        *CHAT_TEMPLATE_FILES,
        *SENTENCE_TRANSFORMERS,
    }
)
# The weights transformers and sentence-transformers load, in the order they
# prefer them: a folder's files of the first format it has are pulled.
WEIGHT_FORMATS = (
    re.compile(r"^model(-\d+-of-\d+)?\.safetensors$|^model\.safetensors\.index\.json$"),
    re.compile(r"^pytorch_model(-\d+-of-\d+)?\.bin$|^pytorch_model\.bin\.index\.json$"),
)
# Bytes per parameter of each safetensors dtype.
DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


@dataclass(frozen=True)
class FolderFacts:
    """What a transformers or sentence-transformers repository's small files
    and weight headers say, before its weights are downloaded."""

    files: tuple[HubFile, ...]
    format: str  # "embedding" or "transformers" (catalog.models.ModelFormat)
    task: str  # "embedding", "chat" or "completion"
    architecture: str
    context_length: int
    # Parameters by safetensors dtype ({} for pytorch_model*.bin weights).
    parameters: dict[str, int] = field(default_factory=dict)
    needs_mib: float = 0.0


def is_folder_model(repo: HubRepo) -> bool:
    """Whether the repository is a transformers model: a config.json and
    weights in a format transformers loads, at its top."""
    names = {f.name for f in repo.files}
    return CONFIG in names and bool(_weights(repo.files, ""))


def folder_facts(
    repo: HubRepo,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> FolderFacts:
    """The model's files, kind, context and memory need, from its small
    files and its safetensors headers read at the repository's commit;
    HubError (400) for a repository that is not a transformers model."""
    if not is_folder_model(repo):
        raise HubError(
            400,
            f"{repo.repo_id} has no GGUF file, nor a config.json with weights "
            "transformers loads (model*.safetensors or pytorch_model*.bin)",
        )
    endpoint = hub_endpoint(endpoint)
    token = hub_token() if token is None else token

    def read_json(name: str) -> dict | list:
        return _json(repo, hub_file_bytes(repo, name, endpoint=endpoint, token=token))

    def read_object(name: str) -> dict:
        found = read_json(name)
        if not isinstance(found, dict):
            raise HubError(400, f"{repo.repo_id}/{name} is not a JSON object")
        return found

    names = {f.name for f in repo.files}
    config = read_object(CONFIG)
    sentence = any(name in names for name in SENTENCE_TRANSFORMERS)
    folders = [""]
    if MODULES in names:
        modules = read_json(MODULES)
        folders += [
            str(m.get("path") or "").strip("/")
            for m in (modules if isinstance(modules, list) else [])
            if isinstance(m, dict) and str(m.get("path") or "").strip("/")
        ]
    files = tuple(f for f in repo.files if _allowed(f, folders, repo.files))
    if sentence:
        format_, task = "embedding", "embedding"
    else:
        format_ = "transformers"
        chat = any(name in names for name in CHAT_TEMPLATE_FILES) or (
            TOKENIZER_CONFIG in names
            and bool(read_object(TOKENIZER_CONFIG).get("chat_template"))
        )
        task = "chat" if chat else "completion"
    parameters = _parameters(repo, files, endpoint=endpoint, token=token)
    weights = (
        sum(count * DTYPE_BYTES.get(dtype, 4) for dtype, count in parameters.items())
        if parameters
        else sum(f.size for f in _weights(files, "") if f.name.endswith(".bin"))
    )
    return FolderFacts(
        files=files,
        format=format_,
        task=task,
        architecture=str(config.get("model_type") or ""),
        context_length=int(config.get("max_position_embeddings") or 0),
        parameters=parameters,
        needs_mib=_needs_mib(format_, config, weights),
    )


def _allowed(file: HubFile, folders: list[str], every: tuple[HubFile, ...]) -> bool:
    """Whether the file is part of the model: a side file or a weight of its
    folder's one format, in the top folder or a sentence-transformers
    module's."""
    path = PurePosixPath(file.name)
    folder = str(path.parent) if str(path.parent) != "." else ""
    if folder not in folders:
        return False
    if path.name in SIDE_FILES or (folder and path.suffix == ".json"):
        return True
    return file in _weights(every, folder)


def _weights(files: tuple[HubFile, ...], folder: str) -> list[HubFile]:
    """A folder's weights in the first format of WEIGHT_FORMATS it has."""
    prefix = f"{folder}/" if folder else ""
    here = [
        f
        for f in files
        if f.name.startswith(prefix) and "/" not in f.name[len(prefix) :]
    ]
    for pattern in WEIGHT_FORMATS:
        chosen = [f for f in here if pattern.match(f.name[len(prefix) :])]
        if any(not f.name.endswith(".json") for f in chosen):
            return chosen
    return []


def _parameters(
    repo: HubRepo,
    files: tuple[HubFile, ...],
    *,
    endpoint: str | None,
    token: str | bool,
) -> dict[str, int]:
    """Parameters by dtype in the top folder's safetensors headers (ranged
    reads of a few KiB each); {} when the weights are not safetensors."""
    if not any(f.name.endswith(".safetensors") and "/" not in f.name for f in files):
        return {}
    api = HfApi(endpoint=endpoint, token=token)
    with hub_errors(repo.repo_id, repo.commit):
        try:
            found = api.get_safetensors_metadata(repo.repo_id, revision=repo.commit)
        except (NotASafetensorsRepoError, SafetensorsParsingError) as error:
            raise HubError(
                400, f"{repo.repo_id}: its safetensors headers: {error}"
            ) from None
    return dict(sorted(found.parameter_count.items()))


def _needs_mib(format_: str, config: dict, weights: int) -> float:
    """Memory served, as estimate_model_mib counts it once on disk: an
    embedder's weights; a transformers model's weights as loaded and its KV
    cache at its trained context up to DEFAULT_CONTEXT, one slot."""
    if format_ == "embedding":
        return weights / MIB
    return transformers_estimate_mib(config, weights)


def _json(repo: HubRepo, data: bytes) -> dict | list:
    """A small file's JSON; HubError (400) for one that is not."""
    try:
        return json.loads(data)
    except ValueError as error:
        raise HubError(
            400, f"{repo.repo_id}: a config file is not JSON ({error})"
        ) from None
