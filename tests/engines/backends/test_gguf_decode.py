"""llama.cpp decodes with the bundled SmolLM2 GGUF on this CPU (no AMX crash)."""

import json

from tests.conftest import run_python

DECODE = """
import json, sys
from engines.backends import llama
model = llama.load(sys.argv[1] if len(sys.argv) > 1 else MODEL, n_ctx=256)
tokens = []
for token in model.generate(model.tokenize(b"The capital of France is"), temp=0.0):
    tokens.append(token)
    if len(tokens) == 8:
        break
print(json.dumps({"tokens": tokens,
                  "text": model.detokenize(tokens).decode("utf-8", "replace"),
                  "system_info": llama.system_info()}))
"""


def decode_report(models_dir, script: str):
    """Run a decode script on the bundled SmolLM2 in a child process (a
    crash shows as a signal); its last line of output, as JSON."""
    model = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = run_python(f"MODEL = {str(model)!r}\n{script}", timeout=300)
    assert result.returncode == 0, f"decode died ({result.returncode}): {result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_decode_produces_tokens_without_amx(models_dir):
    """A real decode runs in a child process (a crash would show as a signal) and
    the build reports no AMX kernels."""
    report = decode_report(models_dir, DECODE)
    assert len(report["tokens"]) == 8
    assert "Paris" in report["text"]
    assert "AMX_INT8 = 1" not in report["system_info"]


FIRST_TOKENS_FIRST = """
import json
from engines.backends.gguf import LlamaBackend
from engines.generation.runner import GenerationRequest
from engines.generation.sampling import SamplingParams

backend = LlamaBackend(MODEL, n_slots=3, context_length=768, n_threads=2)
events = []

def request(name, prompt):
    def emit(event, name=name):
        events.append((name, event["event"]))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return GenerationRequest(backend.tokenize(prompt), params, emit)

backend.admit(request("a", "Once upon a time"))
backend.admit(request("b", "The lighthouse keeper said"))
while ("b", "token") not in events:
    backend.step()  # a and b prefill and start decoding
backend.admit(request("c", "A storm was coming and"))
del events[:]
backend.step()  # c's prompt ends in this pass, alongside a's and b's next tokens
print(json.dumps(events))
backend.close()
"""


def test_a_first_token_leaves_before_running_streams_tokens(models_dir):
    """In a pass where one slot's prompt ends while others decode, the new
    stream's first token is emitted before the running streams' next tokens
    (the relays downstream pass tokens on in the order they leave)."""
    events = decode_report(models_dir, FIRST_TOKENS_FIRST)
    tokens = [name for name, kind in events if kind == "token"]
    # Every stream produced a token in that pass, the new one first.
    assert sorted(tokens) == ["a", "b", "c"], events
    assert tokens[0] == "c", events


GREEDY_AGAINST_SAMPLER = """
import json
from engines.backends.gguf import LlamaBackend
from engines.generation.runner import GenerationRequest
from engines.generation.sampling import SamplingParams

backend = LlamaBackend(MODEL, n_slots=4, context_length=512, n_threads=2)
texts = {}

def request(name, prompt, **sampling):
    def emit(event, name=name):
        if event["event"] == "token":
            texts[name] = texts.get(name, "") + event["text"]
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    return GenerationRequest(backend.tokenize(prompt), params, emit)

prompts = {"ships": "The history of ships", "bread": "To bake bread, first"}
for name, prompt in prompts.items():
    # greedy with no penalty: no sampler chain, the row's argmax
    backend.admit(request(name + "/greedy", prompt, temperature=0.0))
    # llama.cpp's chain keeping one candidate: top-k 1, then its dist sampler
    backend.admit(request(name + "/top1", prompt, temperature=0.7, top_k=1))
chains = [slot.state is not None for slot in backend.slots]
while backend.active():
    backend.step()
print(json.dumps({"texts": texts, "chains": chains}))
backend.close()
"""


def test_greedy_picks_what_llama_cpps_sampler_picks(models_dir):
    """Greedy requests with no penalty take each row's argmax with no sampler
    chain (one numpy pass instead of llama.cpp's copy of the vocabulary); the
    text equals that of llama.cpp's own chain keeping only the top candidate,
    run in the same passes."""
    report = decode_report(models_dir, GREEDY_AGAINST_SAMPLER)
    assert report["chains"] == [False, True, False, True]  # the argmax path ran
    texts = report["texts"]
    for name in ("ships", "bread"):
        assert texts[f"{name}/greedy"].strip(), texts
        assert texts[f"{name}/greedy"] == texts[f"{name}/top1"], texts


BUNCHED_PROMPTS = """
import json
import engines.backends.gguf as gguf
from engines.backends.gguf import LlamaBackend
from engines.generation.runner import GenerationRequest
from engines.generation.sampling import SamplingParams

SHARED = gguf.PROMPT_TOKENS_SHARED if CAPPED else gguf.BATCH_TOKENS
gguf.PROMPT_TOKENS_SHARED = SHARED
backend = LlamaBackend(MODEL, n_slots=6, context_length=768, n_threads=2)
firsts = []

def request(name, prompt):
    def emit(event, name=name):
        if event["event"] == "token" and name not in firsts:
            firsts.append(name)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    return GenerationRequest(backend.tokenize(prompt), params, emit)

backend.admit(request("running", "Once upon a time"))
while "running" not in firsts:
    backend.step()
# Four turns arrive at once beside the running stream, ~60 tokens each.
turn = "the ferry leaves at dawn " * 12
for name in "abcd":
    backend.admit(request(name, f"Question {name}: {turn}"))
steps = []
while len(firsts) < 5:
    backend.step()
    steps.append([name for name in "abcd" if name in firsts])
# A long prompt alone reads whole chunks of BATCH_TOKENS.
for slot in backend.slots:
    if slot.request is not None:
        backend.cancel(slot.request.id)
backend.admit(request("long", "the harbour at dawn was quiet " * 60))
alone = 0
while "long" not in firsts:
    backend.step()
    alone += 1
print(json.dumps({"shared": SHARED, "steps": steps, "alone": alone}))
"""


def test_bunched_prompts_beside_a_stream_get_their_first_tokens_in_turn(models_dir):
    """Four ~60-token prompts arriving together beside a running stream are
    read PROMPT_TOKENS_SHARED (128) tokens a step, oldest first: the first
    two have their first token after one step, the last two a step later
    (control: with the cap at BATCH_TOKENS all four come in the same step).
    A ~360-token prompt alone is read in one step."""
    report = decode_report(models_dir, f"CAPPED = True\n{BUNCHED_PROMPTS}")
    assert report["shared"] == 128
    assert report["steps"][0] == ["a", "b"], report
    assert report["steps"][1] == ["a", "b", "c", "d"], report
    assert report["alone"] == 1, report
    control = decode_report(models_dir, f"CAPPED = False\n{BUNCHED_PROMPTS}")
    assert control["steps"][0] == ["a", "b", "c", "d"], control
