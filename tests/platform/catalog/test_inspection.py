"""Inspecting a model's files (catalog.inspection) on the bundled models and on
small files built here: what each kind of file says, and a clear problem for
files that do not tell."""

import json
import struct

import numpy as np
import pytest
from gguf import GGUFWriter
from safetensors import safe_open
from safetensors.numpy import save_file

from catalog.inspection import inspect_model_files
from engines.backends.ggufmeta import read_header

TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)


def test_a_bundled_gguf_model(models_dir):
    """SmolLM2: the architecture, context and quantization from its metadata,
    its parameter count as the engines' own header reader counts it, a chat
    template without tools."""
    path = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    found = inspect_model_files("gguf", path)
    assert found.problem == ""
    assert (found.architecture, found.quantization) == ("llama", "Q4_1")
    assert found.context_length == 8192
    assert found.parameters == read_header(path).parameters == 134_515_008
    assert found.chat_template and not found.tool_calls


def test_a_gguf_whose_template_renders_tools(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_file_type(1)  # MOSTLY_F16
    writer.add_chat_template(TOOLS_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = inspect_model_files("gguf", path)
    assert found.as_dict() == {
        "architecture": "llama",
        "parameters": 128,
        "quantization": "F16",
        "context_length": 4096,
        "chat_template": True,
        "tool_calls": True,
        "problem": "",
    }


def test_a_bundled_embedding_folder(models_dir):
    """all-MiniLM-L6-v2: its config's architecture and positions; parameters
    from the safetensors header, as the safetensors library counts them."""
    path = models_dir / "all-MiniLM-L6-v2"
    found = inspect_model_files("embedding", path)
    expected = 0
    for file in path.rglob("*.safetensors"):
        with safe_open(str(file), "np") as weights:
            for name in weights.keys():  # noqa: SIM118 (not a dict)
                expected += int(np.prod(weights.get_slice(name).get_shape()))
    assert found.problem == ""
    assert (found.architecture, found.context_length) == ("BertModel", 512)
    assert found.parameters == expected > 20_000_000
    assert not found.chat_template


def test_a_transformers_folder_with_a_tools_template(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "max_position_embeddings": 2048,
                "torch_dtype": "bfloat16",
            }
        )
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": TOOLS_TEMPLATE}]})
    )
    save_file({"w": np.zeros((3, 5), dtype=np.float32)}, tmp_path / "m.safetensors")
    found = inspect_model_files("transformers", tmp_path)
    assert (found.architecture, found.parameters) == ("LlamaForCausalLM", 15)
    assert (found.quantization, found.context_length) == ("bfloat16", 2048)
    assert found.chat_template and found.tool_calls and found.problem == ""


def test_files_that_do_not_tell_give_a_problem(tmp_path):
    missing = inspect_model_files("gguf", tmp_path / "gone.gguf")
    assert missing.problem.startswith("not found")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert "cannot read notes.gguf" in inspect_model_files("gguf", text).problem
    folder = tmp_path / "folder"
    folder.mkdir()
    assert "no config.json" in inspect_model_files("transformers", folder).problem
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    empty = inspect_model_files("transformers", folder)
    assert empty.architecture == "llama"
    assert "no .safetensors weights" in empty.problem


def test_a_huge_safetensors_header_is_refused_before_reading_it(tmp_path):
    """The header's size comes first in the file: one past the cap is a
    problem, not a 1 TiB allocation."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    bad = tmp_path / "m.safetensors"
    bad.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    found = inspect_model_files("transformers", tmp_path)
    assert "safetensors header of 1099511627776 bytes" in found.problem


@pytest.mark.parametrize(
    ("fmt", "problem"),
    [
        ("gguf", "cannot read x.bin: GGUF magic invalid"),
        ("transformers", "not a GGUF file or a model folder"),
    ],
)
def test_a_file_that_is_neither_kind(tmp_path, fmt, problem):
    target = tmp_path / "x.bin"
    target.write_bytes(b"\0" * 16)
    assert problem in inspect_model_files(fmt, target).problem
