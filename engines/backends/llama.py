"""llama.cpp set up once per process (its backend, and its log forwarded to
ours), for the GGUF backend and the inspection tools that call llama.cpp
directly (quantize, evaluate)."""

import ctypes
import logging
from pathlib import Path
from typing import Any

import llama_cpp

log = logging.getLogger("roundhouse.engine.gguf")

_backend_ready = False
# llama.cpp calls the log callback for the life of the process: the ctypes object
# must never be collected (a collected callback crashes the process).
_LOG_CALLBACK: Any = None


@llama_cpp.llama_log_callback
def _forward_log(level: int, text: bytes, user_data: Any) -> None:
    # ggml log levels: 3 = warning, 4 = error; everything below is noise here.
    if level in (3, 4) and text:
        log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


def init_llama_cpp() -> None:
    """Initialise llama.cpp's backend and route its warnings to our log (once)."""
    global _backend_ready, _LOG_CALLBACK
    if not _backend_ready:
        _LOG_CALLBACK = _forward_log
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


def system_info() -> str:
    """The CPU features this llama.cpp build uses (AMX must not be among them)."""
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


def load(path: Path | str, *, n_ctx: int = 2048, n_threads: int | None = None):
    """Load a GGUF model with llama-cpp-python's high-level class (used by the
    decode smoke test; engines use LlamaBackend)."""
    init_llama_cpp()
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, verbose=False
    )
