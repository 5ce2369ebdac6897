"""What a model's files say about it, read without loading it: a GGUF file's
metadata (the `gguf` package), or a transformers / sentence-transformers
folder's config and safetensors headers. No ML library is imported (numpy
only, through `gguf`). Meant for the catalog's model inspection, which a
Celery task is to run when a model is added or its path changes.

`inspect_model_files` never raises for a bad model: a missing, unreadable or
malformed file gives an Inspection whose `problem` says what is wrong."""

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

# A safetensors header larger than this is refused (read before allocating).
MAX_SAFETENSORS_HEADER = 100 * 2**20
# A chat template that reads `tools` renders the tools offered itself; the
# engines decide the same way (engines.constrained.toolcalls.template_knows_tools) and
# describe the tools in a system message to a model whose template does not.
TOOL_MARKERS = ("tools",)


@dataclass(frozen=True)
class Inspection:
    architecture: str = ""
    parameters: int | None = None
    quantization: str = ""
    context_length: int | None = None
    chat_template: bool = False
    tool_calls: bool = False
    problem: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def inspect_model_files(fmt: str, path: str | Path) -> Inspection:
    """Inspect a model of format `fmt` ("gguf", "transformers", "embedding")
    at `path`."""
    path = Path(path)
    if not path.exists():
        return Inspection(problem=f"not found: {path}")
    try:
        if path.is_file() and (fmt == "gguf" or path.suffix == ".gguf"):
            return _inspect_gguf(path)
        if path.is_dir():
            return _inspect_folder(path)
        return Inspection(problem=f"not a GGUF file or a model folder: {path}")
    except (OSError, ValueError, KeyError, IndexError, struct.error) as error:
        return Inspection(problem=f"cannot read {path.name}: {error}")


def template_facts(template: str) -> tuple[bool, bool]:
    """Whether there is a chat template, and whether it renders tools."""
    return bool(template), any(marker in template for marker in TOOL_MARKERS)


def _inspect_gguf(path: Path) -> Inspection:
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(path))

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = str(value("general.architecture") or "")
    file_type = value("general.file_type")
    quantization = ""
    if file_type is not None:
        try:
            quantization = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
        except ValueError:
            quantization = f"file type {file_type}"
    context = value(f"{arch}.context_length")
    template, tools = template_facts(str(value("tokenizer.chat_template") or ""))
    return Inspection(
        architecture=arch,
        parameters=sum(int(tensor.n_elements) for tensor in reader.tensors),
        quantization=quantization,
        context_length=int(context) if context is not None else None,
        chat_template=template,
        tool_calls=tools,
    )


def _inspect_folder(path: Path) -> Inspection:
    config_file = path / "config.json"
    if not config_file.exists():
        return Inspection(problem=f"no config.json in {path}")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    architectures = config.get("architectures") or [config.get("model_type", "")]
    template = ""
    tokenizer_config = path / "tokenizer_config.json"
    if tokenizer_config.exists():
        raw = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        found = raw.get("chat_template") or ""
        if isinstance(found, list):  # named templates: [{"name", "template"}]
            found = " ".join(str(item.get("template", "")) for item in found)
        template = str(found)
    if not template and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    has_template, tools = template_facts(template)
    weights = sorted(path.rglob("*.safetensors"))
    parameters = sum(_safetensors_parameters(file) for file in weights) or None
    return Inspection(
        architecture=str(architectures[0]),
        parameters=parameters,
        quantization=str(config.get("dtype") or config.get("torch_dtype") or ""),
        context_length=config.get("max_position_embeddings"),
        chat_template=has_template,
        tool_calls=tools,
        problem="" if weights else f"no .safetensors weights in {path}",
    )


def _safetensors_parameters(file: Path) -> int:
    """Parameters in a safetensors file, from its JSON header alone."""
    with file.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        if size > MAX_SAFETENSORS_HEADER:
            raise ValueError(f"safetensors header of {size} bytes")
        header = json.loads(handle.read(size))
    total = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in tensor["shape"]:
            count *= int(dim)
        total += count
    return total
