"""What /api/tags, /api/show and /api/ps say, from the catalog (a model's
row, its inspection, its file: size, GGUF header) and the fleet (the engines
that hold it, as the supervisor last recorded them). Every function here
reads the database or files: run them off the event loop (in_db_thread)."""

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from catalog.models import ModelConfig, ModelPathError
from engines.backends.ggufmeta import GGUFFormatError, read_header
from fleet.models import EngineState

from . import protocol

# GGUF metadata /api/show leaves out: the tokenizer's (long arrays, shown
# as their first element) and the chat template (shown as `template`).
HIDDEN_METADATA = ("tokenizer.",)
MIB = 1024 * 1024
# A model with no idle limit (keep-alive 0) stays until its memory is
# needed: Ollama shows such a model's expiry far ahead.
FOREVER = datetime(2318, 1, 1, tzinfo=UTC)


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Facts:
    """What the catalog and the model's files say about one model."""

    model: ModelConfig
    size: int
    digest: str
    details: protocol.Details
    metadata: dict[str, Any]
    template: str
    context_length: int

    def listed(self) -> protocol.ListedModel:
        return protocol.ListedModel(
            name=self.model.name,
            model=self.model.name,
            modified_at=iso(self.model.updated_at),
            size=self.size,
            digest=self.digest,
            details=self.details,
        )


def _files_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def _quantization(file_type: Any) -> str:
    if file_type is None:
        return ""
    from gguf import LlamaFileType  # numpy only: no ML library

    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (ValueError, TypeError):
        return ""


def _parameter_size(count: int | None) -> str:
    """Ollama's way: 135M, 1.5B."""
    if not count:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)


def model_facts(model: ModelConfig) -> Facts:
    """A model's size on this host (0 when its files are elsewhere), digest
    (its file's SHA-256 when the catalog has it, else one of its name and
    file), details and GGUF metadata."""
    try:
        path = model.resolved_path
        size = _files_size(path)
    except (OSError, ModelPathError):
        path, size = None, 0
    metadata: dict[str, Any] = {}
    if model.format == "gguf" and path is not None:
        try:
            header = read_header(path)
        except (OSError, GGUFFormatError):
            header = None
        if header is not None:
            metadata = {
                key: value
                for key, value in header.metadata.items()
                if not key.startswith(HIDDEN_METADATA)
                and key != "tokenizer.chat_template"
            }
            metadata["general.parameter_count"] = header.parameters
            template = header.get("tokenizer.chat_template")
            if isinstance(template, str):
                metadata.setdefault("_template", template)
    inspected = model.inspection or {}
    architecture = str(
        metadata.get("general.architecture") or inspected.get("architecture") or ""
    )
    quantization = (
        _quantization(metadata.get("general.file_type"))
        or inspected.get("quantization")
        or model.quantized_to
        or ("F32" if model.format == "embedding" else "")
    )
    parameters = metadata.get("general.parameter_count") or inspected.get("parameters")
    context = (
        model.context_length
        or metadata.get(f"{architecture}.context_length")
        or inspected.get("context_length")
        or 0
    )
    digest = (model.file_digests or {}).get("") or hashlib.sha256(
        f"{model.name}\0{model.path}\0{size}".encode()
    ).hexdigest()
    details = protocol.Details(
        format="gguf" if model.format == "gguf" else "safetensors",
        family=architecture,
        families=[architecture] if architecture else None,
        parameter_size=_parameter_size(parameters),
        quantization_level=str(quantization),
    )
    template = model.chat_template or str(metadata.pop("_template", "") or "")
    return Facts(
        model=model,
        size=size,
        digest=digest,
        details=details,
        metadata=metadata,
        template=template,
        context_length=int(context),
    )


def models_named(*, names: list[str]) -> list[Facts]:
    """The facts of these enabled models, by name."""
    rows = ModelConfig.objects.filter(name__in=names, enabled=True).order_by("name")
    return [model_facts(model) for model in rows]


def tags(*, names: list[str]) -> protocol.TagsResponse:
    return protocol.TagsResponse(models=[f.listed() for f in models_named(names=names)])


def show(*, name: str) -> protocol.ShowResponse | None:
    """Ollama's model card of the model (None: not in the catalog)."""
    found = models_named(names=[name])
    if not found:
        return None
    facts = found[0]
    model = facts.model
    parameters = [f"num_ctx {facts.context_length}"] if model.context_length else []
    for option, value in sorted((model.sampling or {}).items()):
        parameters.append(f"{option} {value}")
    model_info = dict(facts.metadata)
    architecture = facts.details.family
    if architecture and facts.context_length:
        model_info.setdefault(f"{architecture}.context_length", facts.context_length)
    model_info.setdefault("general.architecture", architecture)
    capabilities = (
        ["embedding"]
        if model.task == "embedding"
        else ["completion", *(["tools"] if "tools" in facts.template else [])]
    )
    modelfile = [f"# Roundhouse model {model.name}", f"FROM {model.path}"]
    if facts.template:
        modelfile.append(f'TEMPLATE """{facts.template}"""')
    modelfile += [f"PARAMETER {line}" for line in parameters]
    return protocol.ShowResponse(
        modelfile="\n".join(modelfile) + "\n",
        parameters="\n".join(parameters),
        template=facts.template,
        details=facts.details,
        model_info=model_info,
        capabilities=capabilities,
        modified_at=iso(model.updated_at),
    )


def running(*, allowed: set[str]) -> protocol.PsResponse:
    """Every model loaded on an engine, per engine, of those `allowed`: its
    memory there and when it would be unloaded if left idle (the supervisor's
    last record: its heartbeat, less the model's idle time, plus its
    keep-alive there: the engine's account, which a request's keep_alive
    sets, else the catalog's)."""
    held: list[tuple[EngineState, dict[str, Any]]] = []
    for state in EngineState.objects.select_related("spec", "spec__node").order_by(
        "spec__name"
    ):
        for item in state.resident_models or ():
            if item.get("name") in allowed:
                held.append((state, item))
    facts = {f.model.name: f for f in models_named(names=[i["name"] for _, i in held])}
    out = []
    for state, item in held:
        found = facts.get(item["name"])
        if found is None:
            continue
        if "keep_alive_s" in item:  # None: no limit
            keep = item["keep_alive_s"]
        else:  # an engine that does not say
            keep = found.model.keep_alive_s or None
        seen = state.heartbeat_at or datetime.now(UTC)
        idle = float(item.get("idle_s") or 0)
        expires = (
            seen + timedelta(seconds=float(keep) - idle)
            if keep is not None
            else FOREVER
        )
        node = state.spec.node
        out.append(
            protocol.RunningModel(
                name=found.model.name,
                model=found.model.name,
                size=int(float(item.get("memory_mib") or 0) * MIB),
                size_vram=int(float(item.get("device_memory_mib") or 0) * MIB),
                digest=found.digest,
                details=found.details,
                expires_at=iso(expires),
                context_length=int(item.get("context") or found.context_length),
                engine=state.spec.name,
                node=node.name if node is not None else "",
            )
        )
    return protocol.PsResponse(models=out)
