"""engines.inspection.evaluate in its own process, on the bundled SmolLM2: speed,
perplexity on the shipped text, greedy continuations, and agreement with a
reference, with controls that show each figure can come out wrong."""

import random
from pathlib import Path

import pytest
from django.conf import settings

from engines.inspection.messages import EVALUATION_TEXT
from tests.engines.inspection.inspection_children import run_inspection

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Small enough for a 2-core machine: two prompts, 24 tokens each, one repeat
# of a 64-token prompt, perplexity over the text's first 1,000 characters; one
# thread, which other work on the machine slows less than two in lockstep.
LIGHT = {"prompts": ["Once upon a time,", "The capital of France is"]}
LIGHT |= {"max_tokens": 24, "repeats": 1, "prompt_tokens": 64, "window": 128}
LIGHT |= {"threads": 1}


@pytest.fixture(scope="module")
def excerpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "excerpt.txt"
    path.write_text(EVALUATION_TEXT.read_text()[:1000])
    return path


@pytest.fixture(scope="module")
def evaluate(excerpt):
    def run(path, **fields):
        request = {"path": str(path), "text_path": str(excerpt), **LIGHT, **fields}
        done = run_inspection("engines.inspection.evaluate", request)
        assert done.returncode == 0, done.stderr
        return done.result

    return run


@pytest.fixture(scope="module")
def measured(evaluate):
    """The model measured once, without a reference."""
    return evaluate(Path(settings.MODELS_DIR) / SMOL)


def test_a_model_measured_alone(measured):
    """Speeds and a perplexity that a 135M model can have on English prose
    (uniform guessing over its 49,152 tokens would score 49,152), greedy
    continuations of each prompt, and no agreement without a reference."""
    assert measured["problem"] == ""
    assert measured["quantization"] == "Q4_1"
    assert measured["prompt_tps"] > 0 and measured["generation_tps"] > 0
    assert 1 < measured["perplexity"] < 100
    # Every token of the excerpt but each window's first.
    assert 200 < measured["perplexity_tokens"] < 260
    assert [len(tokens) for tokens in measured["greedy"]] == [24, 24]
    assert measured["agreement"] is None and measured["identical_prefix"] is None


def test_a_model_agrees_with_its_own_choices_and_not_with_others(
    evaluate, measured, models_dir
):
    """Against its own greedy tokens the model agrees (nearly) everywhere and
    repeats them whole; against the same tokens shifted by one it does not."""
    path = models_dir / SMOL
    own = evaluate(path, reference=measured["greedy"])
    assert own["agreement"] >= 0.95
    assert own["identical_prefix"] == 1.0
    shifted = [[token + 1 for token in tokens] for tokens in measured["greedy"]]
    other = evaluate(path, reference=shifted)
    assert other["agreement"] < 0.2
    assert other["identical_prefix"] == 0.0


def test_perplexity_tells_prose_from_shuffled_words(
    evaluate, excerpt, measured, models_dir, tmp_path
):
    """The same words in a random order are much less likely to the model."""
    words = excerpt.read_text().split()
    random.Random(0).shuffle(words)
    shuffled = tmp_path / "shuffled.txt"
    shuffled.write_text(" ".join(words))
    scrambled = evaluate(models_dir / SMOL, text_path=str(shuffled))
    assert scrambled["perplexity"] > 3 * measured["perplexity"]


def test_what_cannot_be_measured_is_a_problem(evaluate, models_dir, tmp_path):
    """A missing model, or a reference without one list per prompt: a problem
    in the result, not a crash."""
    missing = evaluate(tmp_path / "gone.gguf")
    assert missing["problem"].startswith("not found")
    mismatched = evaluate(models_dir / SMOL, reference=[[1, 2, 3]])
    assert mismatched["problem"] == "the reference needs one list per prompt"
