"""llama.cpp decodes with the bundled SmolLM2 GGUF on this CPU (no AMX crash)."""

import json

from tests.conftest import run_python

DECODE = """
import json, sys
from engines.backends import gguf
model = gguf.load(sys.argv[1] if len(sys.argv) > 1 else MODEL, n_ctx=256)
tokens = []
for token in model.generate(model.tokenize(b"The capital of France is"), temp=0.0):
    tokens.append(token)
    if len(tokens) == 8:
        break
print(json.dumps({"tokens": tokens,
                  "text": model.detokenize(tokens).decode("utf-8", "replace"),
                  "system_info": gguf.system_info()}))
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
