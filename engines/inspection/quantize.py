"""`python -m engines.inspection.quantize`: write a GGUF model in another quantization
with llama.cpp's quantizer (engines.inspection.messages QuantizeRequest on stdin,
QuantizeResult on stdout).

The source may itself be quantized: its tensors are dequantized and quantized
again (`allow_requantize`), which loses a little more than quantizing from the
original weights would; engines.inspection.evaluate measures how much. The file is
written under a temporary name and renamed when complete, so an interrupted
run never leaves a truncated model under the target's name, and an engine that
has the old file open keeps reading the old one."""

import ctypes
import sys
import time
from pathlib import Path

import llama_cpp

from engines.backends.ggufmeta import read_header
from engines.backends.llama import init_llama_cpp
from engines.inspection.messages import (
    MIB,
    QuantizeRequest,
    QuantizeResult,
    inspection_main,
)
from engines.launch.config import usable_cores


def gguf_quantization(path: Path) -> str:
    """The quantization a GGUF file's metadata names (general.file_type)."""
    from gguf import LlamaFileType

    file_type = read_header(path).get("general.file_type")
    if file_type is None:
        return ""
    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file type {file_type}"


def quantize(request: QuantizeRequest) -> QuantizeResult:
    """Quantize the source to the target, or say why not."""
    source, target = Path(request.source), Path(request.target)
    if not source.is_file():
        return QuantizeResult(problem=f"not found: {source}")
    if source.resolve() == target.resolve():
        return QuantizeResult(problem="the target is the source file")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    init_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{request.quantization}")
    params.nthread = request.threads or usable_cores()
    params.allow_requantize = True  # the source may be quantized already
    started = time.perf_counter()
    code = llama_cpp.llama_model_quantize(
        str(source).encode("utf-8"), str(partial).encode("utf-8"), ctypes.byref(params)
    )
    seconds = time.perf_counter() - started
    if code != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        return QuantizeResult(
            problem=f"llama.cpp's quantizer failed on {source.name} (code {code})"
        )
    partial.replace(target)
    return QuantizeResult(
        quantization=gguf_quantization(target),
        file_mib=round(target.stat().st_size / MIB, 1),
        seconds=round(seconds, 2),
    )


if __name__ == "__main__":
    sys.exit(inspection_main(QuantizeRequest, quantize))
