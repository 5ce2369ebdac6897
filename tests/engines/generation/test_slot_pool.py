"""Slot bookkeeping's log-probabilities (engines/generation/slot_pool.py):
computed from the raw float32 logits with a partial selection, they equal a
float64 log-softmax of the whole vocabulary, top tokens in order."""

import numpy as np

from engines.generation.slot_pool import SlotBackend


class Vocabulary:
    """The part of a backend that log-probabilities read: token bytes."""

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    _token_entry = SlotBackend._token_entry
    logprob_entry = SlotBackend.logprob_entry


def test_logprobs_match_a_float64_log_softmax():
    """49,152 logits (SmolLM2's vocabulary), 20 top tokens: the chosen and
    the top tokens' log-probabilities are those of a float64 log-softmax to
    1e-5, the top ones in descending order, and the row is left unchanged."""
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(49_152) * 4).astype(np.float32)
    before = logits.copy()
    wide = logits.astype(np.float64)
    reference = wide - (wide.max() + np.log(np.exp(wide - wide.max()).sum()))
    token = 1234
    entry = Vocabulary().logprob_entry(logits, token, 20)
    assert np.array_equal(logits, before)
    assert abs(entry["logprob"] - reference[token]) < 1e-5
    expected = np.argsort(-reference, kind="stable")[:20]
    assert [e["token"] for e in entry["top_logprobs"]] == [f"<{t}>" for t in expected]
    for item, index in zip(entry["top_logprobs"], expected, strict=True):
        assert abs(item["logprob"] - reference[index]) < 1e-5
    assert Vocabulary().logprob_entry(logits, token, 0)["top_logprobs"] == []
