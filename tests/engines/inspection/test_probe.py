"""engines.inspection.probe in its own process, as the catalog runs it: the memory a
real load of the bundled SmolLM2 takes with a given context and slots, and a
problem (not a crash) for what cannot be loaded."""

import pytest

from engines.backends.memory import plan_slots
from engines.launch.config import Limits, ModelSpec
from tests.engines.inspection.inspection_children import run_inspection

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def probe(path, **fields):
    run = run_inspection(
        "engines.inspection.probe", {"format": "gguf", "path": str(path), **fields}
    )
    assert run.returncode == 0, run.stderr
    return run.result


def test_the_kv_pool_of_the_slot_plan_shows_in_the_measured_memory(models_dir):
    """Two loads of one model: a 256-token context with one slot, then four
    slots of 2,048 tokens. Each reports the slot plan an engine would use,
    and the second grows by about the KV memory the plans differ by (the
    probe measures the real allocation, not the estimate)."""
    path = models_dir / SMOL
    small = probe(path, context_length=256, slots=1)
    large = probe(path, context_length=2048, slots=4)
    for report, (context, slots) in ((small, (256, 1)), (large, (2048, 4))):
        spec = ModelSpec(
            name="m", format="gguf", path=str(path), context_length=context, slots=slots
        )
        plan = plan_slots(spec, Limits())
        assert report["problem"] == ""
        assert (report["slots"], report["context"]) == (slots, context)
        assert report["kv_pool_tokens"] == plan.pool_tokens
        assert report["kv_mib"] == pytest.approx(plan.kv_mib, abs=0.1)
        assert report["host_mib"] > 0 and report["estimated_mib"] > 0
        assert report["device_mib"] is None  # a CPU load: no device figure
    kv_grown = large["kv_mib"] - small["kv_mib"]
    assert kv_grown > 100
    grown = large["host_mib"] - small["host_mib"]
    assert 0.7 * kv_grown < grown < 1.5 * kv_grown + 50


def test_files_that_cannot_be_loaded_give_a_problem(tmp_path):
    """A missing file and one llama.cpp refuses: a problem in the result, and
    no figure."""
    missing = probe(tmp_path / "gone.gguf")
    assert missing["problem"] == f"not found: {tmp_path / 'gone.gguf'}"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    broken = probe(junk, context_length=256, slots=1)
    assert "cannot load" in broken["problem"]
    assert broken["host_mib"] == 0


@pytest.mark.parametrize(
    ("request_text", "named"),
    [
        ('{"format": "gguf", "path": "x.gguf", "token": "s3cret"}', "token"),
        ('{"format": "gguf", "path": "x.gguf", "slots": 0}', "slots"),
        ('{"format": "pickle", "path": "x.gguf"}', "format"),
        ("not json", "json"),
    ],
)
def test_a_request_outside_the_schema_is_refused(request_text, named):
    """Unknown keys, out-of-range values and non-JSON are refused before
    anything is loaded: status 2, nothing on stdout, the reason on stderr."""
    run = run_inspection("engines.inspection.probe", request_text)
    assert run.returncode == 2
    assert run.result is None
    assert "refused request" in run.stderr and named in run.stderr.lower()
