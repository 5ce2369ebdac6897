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


def test_decode_produces_tokens_without_amx(models_dir):
    """A real decode runs in a child process (a crash would show as a signal) and
    the build reports no AMX kernels."""
    model = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = run_python(f"MODEL = {str(model)!r}\n{DECODE}", timeout=300)
    assert result.returncode == 0, f"decode died ({result.returncode}): {result.stderr}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
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
    model = models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = run_python(f"MODEL = {str(model)!r}\n{FIRST_TOKENS_FIRST}", timeout=300)
    assert result.returncode == 0, f"decode died ({result.returncode}): {result.stderr}"
    events = json.loads(result.stdout.strip().splitlines()[-1])
    tokens = [name for name, kind in events if kind == "token"]
    # Every stream produced a token in that pass, the new one first.
    assert sorted(tokens) == ["a", "b", "c"], events
    assert tokens[0] == "c", events
