"""Batch requests (priority "batch": Batch API lines) yield to interactive
ones in the engine: admitted after them, a quarter of the slots left to them,
and out of the pass while an interactive prompt is read. Interactive requests
share the free slots fairly between their callers."""

import json
import threading
from pathlib import Path

import pytest
from django.conf import settings

from engines.wire.client import EngineRequestError
from engines.wire.framing import auth_frame, encode_message
from engines.wire.replies import ModelState
from engines.wire.requests import GenerateRequest
from tests.conftest import run_python
from tests.engines.conftest import start_engine
from tests.engines.raw import raw_exchange
from tests.waiting import wait_for

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """SmolLM2 with 8 slots: batch requests may hold 6 of them."""
    engine = start_engine(
        tmp_path_factory.mktemp("priority"),
        models=[
            {
                "name": SMOL,
                "format": "gguf",
                "task": "chat",
                "path": str(
                    Path(settings.MODELS_DIR) / "SmolLM2-135M-Instruct.Q4_1.gguf"
                ),
                "context_length": 256,
                "slots": 8,
            }
        ],
        preload=[SMOL],
        limits={"max_parallel_requests": 16},
    )
    yield engine
    engine.stop()


def state(engine) -> ModelState:
    return next(m for m in engine.client().state().models if m.name == SMOL)


def in_background(engine, finished: list, name: str, **fields) -> threading.Thread:
    def run():
        try:
            engine.client().generate(
                GenerateRequest(model=SMOL, prompt=f"Story {name}:", **fields)
            )
        except EngineRequestError as error:
            finished.append((name, error.code))
            return
        finished.append((name, "done"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_batch_requests_leave_slots_to_interactive_ones(engine):
    """Eight long batch requests: six run, two wait; an interactive request
    sent then runs at once (a seventh slot), and ends long before them."""
    finished: list = []
    long = {"max_tokens": 60, "ignore_eos": True, "temperature": 0.0}
    threads = [
        in_background(engine, finished, f"b{n}", priority="batch", **long)
        for n in range(8)
    ]
    # Admitted over the next passes: six run, and two stay queued (without
    # the reserve all eight would run).
    wait_for(
        lambda: (state(engine).busy, state(engine).queued) == (6, 2),
        what="six running, two queued",
    )
    live = in_background(engine, finished, "live", max_tokens=4, temperature=0.0)
    live.join(60)
    assert finished[0] == ("live", "done"), finished
    for thread in threads:
        thread.join(300)
    assert sorted(finished) == sorted(
        [("live", "done")] + [(f"b{n}", "done") for n in range(8)]
    )


def test_an_interactive_request_goes_ahead_of_queued_batch_ones(engine, engine_limits):
    """One request at a time: batch requests queued first still wait for an
    interactive request queued after them."""
    engine_limits(engine, max_parallel_requests=1)
    finished: list = []
    running = in_background(engine, finished, "first", max_tokens=60, ignore_eos=True)
    wait_for(lambda: state(engine).busy == 1, what="1 busy")
    batch = [
        in_background(engine, finished, f"b{n}", priority="batch", max_tokens=4)
        for n in range(2)
    ]
    wait_for(lambda: state(engine).queued == 2, what="2 queued")
    live = in_background(engine, finished, "live", max_tokens=4)
    wait_for(lambda: state(engine).queued == 3, what="3 queued")
    for thread in [running, live, *batch]:
        thread.join(120)
    assert [name for name, _ in finished[:2]] == ["first", "live"], finished


def test_a_free_slot_goes_to_the_caller_with_fewest_in_slots(engine, engine_limits):
    """Two requests at a time, both caller a's; a's third and then b's one
    wait. When a's shorter one ends, the slot goes to b (none in slots), not
    to a's third, queued first (a still has one in a slot): b ends second.
    FIFO admission (the control) would end a's third before b."""
    engine_limits(engine, max_parallel_requests=2)
    finished: list = []
    greedy = {"ignore_eos": True, "temperature": 0.0, "caller": "a"}
    first = in_background(engine, finished, "a1", max_tokens=30, **greedy)
    second = in_background(engine, finished, "a2", max_tokens=200, **greedy)
    wait_for(lambda: state(engine).busy == 2, what="2 busy")
    third = in_background(engine, finished, "a3", max_tokens=30, **greedy)
    wait_for(lambda: state(engine).queued == 1, what="1 queued")
    other = in_background(
        engine, finished, "b", max_tokens=4, temperature=0.0, caller="b"
    )
    wait_for(lambda: state(engine).queued == 2, what="2 queued")
    for thread in [first, second, third, other]:
        thread.join(300)
    names = [name for name, _ in finished]
    assert names[:2] == ["a1", "b"], finished
    assert sorted(finished) == sorted(
        (name, "done") for name in ("a1", "a2", "a3", "b")
    )


def test_priority_is_checked(engine):
    """A priority the engine does not know is refused by the engine (sent as
    it is: no client checks it on the way)."""
    message = {"kind": "generate", "model": SMOL, "prompt": "Hi", "priority": "urgent"}
    reply = raw_exchange(
        engine.port, auth_frame(engine.token) + encode_message(message)
    )
    assert reply["code"] == "bad_request"
    assert "priority" in reply["message"]


YIELD = """
import json
import engines.backends.gguf as gguf
import engines.generation.slot_pool as slots
from engines.generation.runner import GenerationRequest
from engines.generation.sampling import SamplingParams

gguf.BATCH_TOKENS = 64  # a long prompt then takes several passes
backend = gguf.LlamaBackend(MODEL, n_slots=6, context_length=512, n_threads=2)


def admit(prompt, background):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    request = GenerationRequest(
        backend.tokenize(prompt), params, lambda event: None, background=background
    )
    backend.admit(request)
    return next(s for s in backend.slots if s.request is request)


batch = admit("Once upon a time", True)
for _ in range(3):
    backend.step()
before = batch.generated
live = admit(" ".join(["The harbour at dawn was quiet."] * 30), False)
steps = 0
while live.generated == 0:
    backend.step()
    steps += 1
during = batch.generated - before
for _ in range(3):
    backend.step()
after = batch.generated - before - during

# Beside a decoding interactive request, batch slots share
# BATCH_TOKENS_BESIDE_LIVE tokens a pass, in turns; without one about, all go.
slots.BATCH_TOKENS_BESIDE_LIVE = 2
others = [admit(f"Chapter {n} begins", True) for n in range(3)]
while any(s.todo for s in [live, *others]):
    backend.step()
batch_slots = [batch, *others]
counts = [s.generated for s in batch_slots]
for _ in range(4):
    backend.step()
beside = [s.generated - c for s, c in zip(batch_slots, counts)]
backend.cancel(live.request.id)
slots.INTERACTIVE_WINDOW_S = 0
counts = [s.generated for s in batch_slots]
backend.step()
alone = [s.generated - c for s, c in zip(batch_slots, counts)]
print(json.dumps({
    "before": before, "steps": steps, "during": during, "after": after,
    "beside": beside, "alone": alone,
}))
"""


def test_batch_slots_yield_to_interactive_ones_in_each_pass(models_dir):
    """While the interactive prompt is read (over several passes: its chunk
    is capped by the pass), the batch request makes no token; it goes on
    after (control: it made tokens before). Beside a decoding interactive
    request, the batch requests share a small budget of tokens a pass, in
    turns; with none about, every batch request takes part in every pass."""
    model = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = run_python(f"MODEL = {str(model)!r}\n{YIELD}", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["before"] >= 2, report
    assert report["steps"] >= 2, report  # the prompt took several passes
    assert report["during"] == 0, report
    assert report["after"] == 3, report
    # Two batch tokens a pass beside the live request: four passes give each
    # of the four batch requests two tokens; alone, each gets one a pass.
    assert report["beside"] == [2, 2, 2, 2], report
    assert report["alone"] == [1, 1, 1, 1], report
