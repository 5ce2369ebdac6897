"""engines.inspection.quantize in its own process: the bundled SmolLM2 (Q4_1) written as
Q4_0 by llama.cpp's quantizer, atomically, and what it refuses."""

from gguf import GGUFReader, LlamaFileType

from tests.engines.inspection.inspection_children import run_inspection

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_q4_1_model_written_as_q4_0(models_dir, tmp_path):
    """The new file says Q4_0 in its metadata (read here by the gguf package,
    not by the tool), keeps every tensor, is smaller (4.5 bits a weight
    instead of 5), and no partial file is left behind."""
    source = models_dir / SMOL
    target = tmp_path / "out" / "smol-q4_0.gguf"
    run = run_inspection(
        "engines.inspection.quantize",
        {"source": str(source), "target": str(target), "quantization": "Q4_0"},
    )
    assert run.returncode == 0, run.stderr
    assert run.result["problem"] == ""
    assert run.result["quantization"] == "Q4_0"
    written, original = GGUFReader(str(target)), GGUFReader(str(source))
    file_type = written.fields["general.file_type"].contents()
    assert LlamaFileType(file_type) == LlamaFileType.MOSTLY_Q4_0
    assert len(written.tensors) == len(original.tensors)
    assert target.stat().st_size < source.stat().st_size
    assert run.result["file_mib"] == round(target.stat().st_size / 2**20, 1)
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_a_missing_source_is_a_problem_and_writes_nothing(tmp_path):
    """A result that names the missing file, and no target file at all."""
    target = tmp_path / "out.gguf"
    run = run_inspection(
        "engines.inspection.quantize",
        {"source": str(tmp_path / "gone.gguf"), "target": str(target)}
        | {"quantization": "Q8_0"},
    )
    assert run.returncode == 0, run.stderr
    assert run.result["problem"].startswith("not found")
    assert list(tmp_path.iterdir()) == []


def test_a_quantization_outside_the_list_is_refused(tmp_path):
    """Only the catalog's quantizations are accepted: F16 is refused unread."""
    run = run_inspection(
        "engines.inspection.quantize",
        {"source": "a.gguf", "target": str(tmp_path / "b.gguf"), "quantization": "F16"},
    )
    assert run.returncode == 2 and run.result is None
    assert "quantization" in run.stderr
