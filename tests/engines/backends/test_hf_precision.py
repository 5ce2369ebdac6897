"""The transformers backend loads as its placement plan says (the tiny Llama the
tests build, on the CPU): the dtype of its parameters, the plan it describes,
batched generation in each precision, and sampling that stays on the logits'
device (the meta device stands in for a GPU: an operation that mixes it with
the CPU fails, as cuda:0 and the CPU did on the first GPU run)."""

import queue
import subprocess
import sys
import time

import pytest
import torch

from engines.backends.hf import TransformersBackend, penalized, sampling_probs
from engines.generation.runner import DecodeThread, GenerationRequest, GenerationRunner
from engines.generation.sampling import SamplingParams
from tests.waiting import wait_for


def generate_together(backend, params: list[SamplingParams]) -> list[list[dict]]:
    """Submit every request at once to a runner over `backend` (one slot each:
    they decode in one batch) and return each one's events up to its last."""
    runner = GenerationRunner(
        backend,
        name="tiny",
        queue_limit=8,
        queue_timeout_s=30,
        decoder=DecodeThread(max_parallel=len(params)),
    )
    try:
        streams = []
        for each in params:
            events: queue.Queue = queue.Queue()
            runner.submit(
                GenerationRequest(
                    prompt_tokens=backend.tokenize("the cat sat on the"),
                    params=each,
                    emit=events.put,
                )
            )
            streams.append(events)
        results = []
        for events in streams:
            got, deadline = [], time.monotonic() + 60
            while not got or got[-1]["event"] in ("admitted", "token"):
                got.append(events.get(timeout=max(deadline - time.monotonic(), 0.01)))
            results.append(got)
        wait_for(lambda: not backend.active(), timeout=10, what="slots free")
        return results
    finally:
        runner.close()


def text_of(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e["event"] == "token")


MIXED = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        seed=7,
        max_tokens=8,
        ignore_eos=True,
        repeat_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    ),
]


@pytest.mark.parametrize(
    ("setting", "expected"),
    [("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16)],
)
def test_the_model_loads_in_the_planned_dtype_and_generates_in_a_batch(
    tiny_llama, setting, expected
):
    """On a CPU engine: auto is float32; an explicit dtype is what the
    parameters are in. Greedy, seeded and penalized requests decoded together
    each finish with their tokens."""
    backend = TransformersBackend(
        tiny_llama, n_slots=3, context_length=64, backend="cpu", dtype=setting
    )
    assert backend.placement.device_map == "cpu"
    assert {p.dtype for p in backend.model.parameters()} == {expected}
    assert backend.device == torch.device("cpu")
    described = backend.describe_placement()
    assert described["loaded_dtype"] == str(expected).removeprefix("torch.")
    assert described["reason"] == f"{described['dtype']} on the CPU"
    results = generate_together(backend, MIXED)
    for events in results:
        assert events[-1]["event"] == "done", events[-1]
        assert events[-1]["usage"]["completion_tokens"] == 8
    backend.close()


def test_a_bad_dtype_on_the_cpu_is_loaded_and_its_warning_shown(tiny_llama):
    backend = TransformersBackend(
        tiny_llama, n_slots=1, context_length=64, dtype="float16"
    )
    assert {p.dtype for p in backend.model.parameters()} == {torch.float16}
    assert backend.placement_text == (
        "float16 on the CPU; float16 on the CPU is slow and some operations "
        "lack it: float32 (or bfloat16, to halve the memory) serves better there"
    )
    backend.close()


def test_a_seed_gives_the_same_sample_in_a_batch(tiny_llama):
    """Two requests with one seed, decoded together, sample the same text
    (each slot's generator, made on the logits' device, seeded once)."""
    backend = TransformersBackend(tiny_llama, n_slots=2, context_length=64)
    seeded = SamplingParams(temperature=1.5, top_k=0, seed=11, max_tokens=12)
    first, second = generate_together(backend, [seeded, seeded])
    assert text_of(first) == text_of(second)
    backend.close()


def test_penalties_stay_on_the_logits_device():
    """The penalty counts are made where the logits are: on the meta device
    (a GPU's stand-in) nothing is read back or mixed with the CPU."""
    logits = torch.zeros(320, device="meta")
    params = SamplingParams(
        repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5
    )
    out = penalized(logits, [5, 9, 5], params)
    assert out.device.type == "meta" and out.shape == logits.shape


def test_penalties_lower_the_tokens_seen():
    logits = torch.tensor([2.0, -1.0, 1.0, 0.5])
    params = SamplingParams(
        repeat_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5
    )
    out = penalized(logits, [0, 1, 0], params)
    # token 0: 2/2 - (2*0.5 + 0.25); token 1: -1*2 - (0.5 + 0.25); others kept
    assert out.tolist() == [-0.25, -2.75, 1.0, 0.5]


def test_top_k_top_p_and_min_p_stay_on_the_logits_device():
    logits = torch.zeros(320, device="meta")
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)
    probs = sampling_probs(logits, params)
    assert probs.device.type == "meta" and probs.shape == logits.shape


def test_the_backend_module_is_what_imports_torch():
    """The planner stays importable without torch (the web side may plan)."""

    code = "import sys, engines.backends.hf_placement; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
