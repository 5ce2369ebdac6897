"""KV groups of a GGUF model (engines/backends/gguf.py): its slots split over
several llama.cpp contexts, each with its share of the KV pool. Driven in a
child interpreter (the test process never imports llama_cpp), on SmolLM2."""

import json

from tests.conftest import run_python

DRIVER = """
import json
from engines.backends.gguf import LlamaBackend
from engines.generation.runner import GenerationRequest
from engines.generation.sampling import SamplingParams

SYSTEM = " ".join(
    f"Rule {n}: answer questions about the harbour of Port {n} politely."
    for n in range(1, 13)
)
QUESTIONS = ["Name a ship.", "Name a port.", "Name a tide.", "Name a crane."]


def backend(groups, pool):
    return LlamaBackend(
        MODEL, n_slots=4, kv_groups=groups, context_length=512,
        pool_tokens=pool, n_threads=2,
    )


class Run:
    def __init__(self, backend):
        self.backend = backend
        self.out = {}

    def admit(self, name, prompt, max_tokens=12):
        record = self.out[name] = {"text": "", "final": None}

        def emit(event):
            if event["event"] == "token":
                record["text"] += event["text"]
            elif event["event"] in ("done", "error"):
                record["final"] = event

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        request = GenerationRequest(self.backend.tokenize(prompt), params, emit)
        self.backend.admit(request)
        slot = next(s for s in self.backend.slots if s.request is request)
        record["group"] = self.backend.group_of(slot)
        return record

    def until(self, done):
        while not done():
            self.backend.step()

    def finish(self):
        self.until(lambda: all(r["final"] for r in self.out.values()))
        return self.out


def chat(model, question):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    return model.render_prompt({"messages": messages})


# `a` reads the system prompt, then b, c and d arrive while it runs: their
# answers and the prompt tokens each copied instead of reading.
def copied_while_a_runs(model):
    run = Run(model)
    first = run.admit("a", chat(model, QUESTIONS[0]), max_tokens=40)
    run.until(lambda: first["text"])  # a's prompt is in its slot's KV
    copied = []
    for name, question in zip("bcd", QUESTIONS[1:]):
        before = model.copied_tokens
        run.admit(name, chat(model, question))
        copied.append(model.copied_tokens - before)
        model.step()
    return run.finish(), copied


# The same four prompts, each alone in a single-group model.
def answered_alone():
    flat = backend(1, 1200)
    alone = {}
    for name, question in zip("abcd", QUESTIONS):
        one = Run(flat)
        one.admit(name, chat(flat, question), max_tokens=40 if name == "a" else 12)
        alone[name] = one.finish()[name]["text"]
    return alone
"""

COPY_WITHIN_AND_ACROSS = """
answers, copied = copied_while_a_runs(backend(2, 1200))
print(json.dumps({"answers": answers, "copied": copied, "alone": answered_alone()}))
"""


def drive(models_dir, script: str) -> dict:
    model = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    code = f"MODEL = {str(model)!r}\n{DRIVER}\n{script}"
    result = run_python(code, timeout=300)
    assert result.returncode == 0, f"driver died ({result.returncode}): {result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_prefix_is_copied_across_groups_or_within_and_answers_do_not_change(
    models_dir,
):
    """Two groups of two slots. While `a` runs, `b` (same system prompt) goes
    to the emptier group, where the prompt's KV is copied over from a's
    context (llama.cpp's sequence state); `c` then finds a slot holding the
    prompt in either group and shares its cells (llama.cpp's sequence copy).
    Every greedy answer is the one the same prompt gets alone in a
    single-group model (a copy that went wrong would change it)."""
    report = drive(models_dir, COPY_WITHIN_AND_ACROSS)
    answers = report["answers"]
    assert answers["b"]["group"] != answers["a"]["group"]
    copied_b, copied_c, _ = report["copied"]
    assert copied_b > 100  # the whole system prompt, across contexts
    assert copied_c > 100  # the same, within c's group
    assert answers["b"]["final"]["usage"]["cached_tokens"] == copied_b
    assert answers["c"]["final"]["usage"]["cached_tokens"] == copied_c
    for name, text in report["alone"].items():
        assert answers[name]["final"]["event"] == "done", answers[name]
        assert answers[name]["text"] == text, name


ROOM_PER_GROUP = """
long = {
    name: "Count the " + word + "s: " + (word + " ") * 300
    for name, word in (("x", "boat"), ("y", "wave"))
}
out = {}
for label, model in (("grouped", backend(2, 1200)), ("one-pool", backend(1, 600))):
    run = Run(model)
    for name, prompt in long.items():
        run.admit(name, prompt, max_tokens=20)
    out[label] = run.finish()
print(json.dumps(out))
"""


def test_new_conversations_go_to_the_emptier_group_and_room_is_per_group(
    models_dir,
):
    """Two ~300-token prompts at once: with two groups of 600 tokens each they
    go to different groups and both finish. The control: one 600-token pool
    (a single group's share) cannot hold both, and the newer one fails with
    `overloaded`."""
    report = drive(models_dir, ROOM_PER_GROUP)
    grouped = report["grouped"]
    assert grouped["x"]["group"] != grouped["y"]["group"]
    for name in "xy":
        assert grouped[name]["final"]["event"] == "done", grouped[name]
        assert grouped[name]["final"]["usage"]["completion_tokens"] == 20
    one_pool = report["one-pool"]
    assert one_pool["x"]["final"]["event"] == "done"
    assert one_pool["y"]["final"]["code"] == "overloaded"


WAIT_FOR_A_PREFIX_BEING_READ = """
model = backend(1, 1200)
run = Run(model)
# Both at once: when b is admitted, a has not read its prompt yet.
run.admit("a", chat(model, QUESTIONS[0]))
run.admit("b", chat(model, QUESTIONS[1]))
b_slot = next(s for s in model.slots if s.request and s.index != 0)
awaited = b_slot.awaiting is not None
answers = run.finish()
alone = {}
for name, question in zip("ab", QUESTIONS):
    one = Run(backend(1, 1200))
    one.admit(name, chat(one.backend, question))
    alone[name] = one.finish()[name]["text"]
print(json.dumps({
    "answers": answers, "awaited": awaited, "copied": model.copied_tokens,
    "alone": alone,
}))
"""


def test_a_prefix_still_being_read_is_waited_for_and_copied(models_dir):
    """Two conversations with one system prompt arrive at once: the second
    waits for the first to read the prompt, then copies it instead of
    reading it a second time (its cached_tokens count it); both answers are
    the ones each gets alone."""
    report = drive(models_dir, WAIT_FOR_A_PREFIX_BEING_READ)
    answers = report["answers"]
    assert report["awaited"]
    assert report["copied"] > 100
    assert answers["b"]["final"]["usage"]["cached_tokens"] == report["copied"]
    assert answers["a"]["final"]["usage"]["cached_tokens"] == 0
    for name, text in report["alone"].items():
        assert answers[name]["text"] == text, name


STREAMS = """
streamed = LlamaBackend(
    MODEL, n_slots=4, kv_streams=True, context_length=512, n_threads=2,
)
answers, copied = copied_while_a_runs(streamed)
# Every stream holds its whole context at once: four ~450-token prompts.
full = Run(streamed)
for name, word in zip("wxyz", ("boat", "wave", "tide", "gull")):
    full.admit(name, "Count the " + word + "s: " + (word + " ") * 440, max_tokens=8)
filled = full.finish()
print(json.dumps({
    "answers": answers, "copied": copied, "alone": answered_alone(),
    "filled": filled,
    "groups": streamed.kv_groups, "pool": streamed.pool_tokens,
}))
"""


def test_kv_streams_copy_a_prefix_and_each_holds_its_whole_context(models_dir):
    """One context with a KV stream per slot (llama.cpp's kv_unified off):
    the system prompt `a` read is copied into b's, c's and d's streams (the
    sequence's state: llama.cpp copies only whole streams), and each greedy
    answer is the one the prompt gets alone in a unified context (a copy
    that went wrong would change it). Four prompts near the context's length
    at once all finish: each stream holds its own whole context (a unified
    pool of the same size, shared, would hold them too; a pool of one
    context would not: test_new_conversations_go_to_the_emptier_group...)."""
    report = drive(models_dir, STREAMS)
    assert (report["groups"], report["pool"]) == (1, 4 * 512)
    answers = report["answers"]
    assert all(count > 100 for count in report["copied"]), report["copied"]
    for name, count in zip("bcd", report["copied"], strict=True):
        assert answers[name]["final"]["usage"]["cached_tokens"] == count
    for name, text in report["alone"].items():
        assert answers[name]["final"]["event"] == "done", answers[name]
        assert answers[name]["text"] == text, name
    for name, record in report["filled"].items():
        assert record["final"]["event"] == "done", (name, record)
        assert record["final"]["usage"]["prompt_tokens"] > 440
