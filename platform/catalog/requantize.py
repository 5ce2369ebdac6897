"""A GGUF model requantized for this host, and how it compares with its
original: the variant's file is written by `python -m engines.inspection.quantize`, then
each model is measured by `python -m engines.inspection.evaluate` in its own child
process (prompt and generation speed here, perplexity on the shipped text,
greedy continuations), the variant against the original's continuations.

On a CPU the quantization decides the speed as much as the size does:
llama.cpp repacks Q4_0 (and a few others) for its fastest matrix kernels, so
a Q4_1 model requantized to Q4_0 reads prompts about three times faster here
for a small loss of quality. The comparison lets an operator choose knowingly."""

import hashlib
import re
import socket
from collections.abc import Callable
from pathlib import Path

from engines.inspection.messages import (
    EvaluateRequest,
    EvaluateResult,
    QuantizeRequest,
    QuantizeResult,
)

from .tool_processes import run_inspection

# Under the models directory: where variants' files are written.
VARIANTS_DIR = "requantized"
# Each child is killed past its limit (quantizing a large model takes minutes).
QUANTIZE_TIMEOUT_S = 1800.0
EVALUATE_TIMEOUT_S = 900.0
# What the comparison keeps of each model's evaluation.
MEASURES = ("quantization", "file_mib", "prompt_tps", "generation_tps", "perplexity")


def variant_name(original: str, quantization: str) -> str:
    """The catalog name of a model's variant: `smollm2-q4_0`."""
    return f"{original}-{quantization.lower()}"


def variant_path(name: str) -> str:
    """The variant's file, relative to the models directory: its name, when
    that is a plain lowercase file name; else the name made one, with a hash
    of the whole name (`a/b` and `a_b`, or `A` and `a` on a filesystem that
    ignores case, would otherwise share a file)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    if safe != name.lower():
        safe += "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{VARIANTS_DIR}/{safe}.gguf"


def requantize(
    *,
    source: Path,
    target: Path,
    quantization: str,
    progress: Callable[[str], None],
) -> tuple[dict, str]:
    """Write the variant and measure both models: (the comparison, "") or
    ({}, the problem). `progress` hears each stage as it starts."""
    progress(f"quantizing to {quantization}")
    request = QuantizeRequest(
        source=str(source), target=str(target), quantization=quantization
    )
    made = run_inspection(
        "engines.inspection.quantize",
        request,
        QuantizeResult,
        timeout_s=QUANTIZE_TIMEOUT_S,
    )
    if made.problem:
        return {}, f"quantizing: {made.problem}"
    progress("measuring the original")
    original = run_inspection(
        "engines.inspection.evaluate",
        EvaluateRequest(path=str(source)),
        EvaluateResult,
        timeout_s=EVALUATE_TIMEOUT_S,
    )
    if original.problem:
        return {}, f"measuring the original: {original.problem}"
    progress("measuring the variant")
    variant = run_inspection(
        "engines.inspection.evaluate",
        EvaluateRequest(path=str(target), reference=original.greedy),
        EvaluateResult,
        timeout_s=EVALUATE_TIMEOUT_S,
    )
    if variant.problem:
        return {}, f"measuring the variant: {variant.problem}"
    return comparison(original, variant, made), ""


def comparison(
    original: EvaluateResult, variant: EvaluateResult, made: QuantizeResult
) -> dict:
    """The side-by-side figures stored on the variant (ModelConfig.comparison)."""
    request = EvaluateRequest(path="")  # the defaults both were measured with
    return {
        "original": {key: getattr(original, key) for key in MEASURES},
        "variant": {
            **{key: getattr(variant, key) for key in MEASURES},
            "agreement": variant.agreement,
            "identical_prefix": variant.identical_prefix,
        },
        "quantize_s": made.seconds,
        "host": socket.gethostname(),
        "threads": variant.threads,
        "text": Path(request.text_path).name,
        "perplexity_tokens": variant.perplexity_tokens,
        "prompts": len(request.prompts),
        "max_tokens": request.max_tokens,
        "prompt_tokens": request.prompt_tokens,
    }
