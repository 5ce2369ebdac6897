"""GGUF models through llama.cpp (llama-cpp-python). Imported only in engines."""

from pathlib import Path

import llama_cpp


def system_info() -> str:
    """The CPU features this llama.cpp build uses (AMX must not be among them)."""
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


def load(path: Path | str, *, n_ctx: int = 2048, n_threads: int | None = None):
    """Load a GGUF model for inference on this engine's devices."""
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, verbose=False
    )
