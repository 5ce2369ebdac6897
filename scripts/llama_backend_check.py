"""Checks that the installed llama.cpp has the GPU backend its build asked for.

`scripts/setup` runs this after installing llama-cpp-python, with the CMAKE_ARGS
it was built with: `python scripts/llama_backend_check.py "$cmake_args"`. A
build asked for CUDA, HIP or Vulkan (-DGGML_CUDA=ON, ...) that came out without
it (a wheel built elsewhere, flags that did not reach the build) would otherwise
run every model on the CPU without a word. Exit status 0 when every backend
asked for is there (or none was asked for), 1 with a message naming what was
asked and what was built otherwise.

What was built is read from ggml's backend registry (libggml's
ggml_backend_reg_count / _get / _name, through ctypes: llama-cpp-python binds
no registry call). llama.cpp's llama_supports_gpu_offload() is reported too: it
also needs a card to be visible now, which a build host may lack.
"""

import ctypes
import shlex
import sys
from pathlib import Path

# CMake option -> the names ggml's registry gives that backend (HIP builds of
# ggml-cuda register as "ROCm").
GPU_OPTIONS = {
    "GGML_CUDA": ("CUDA",),
    "GGML_HIP": ("ROCm", "HIP"),
    "GGML_VULKAN": ("Vulkan",),
}
TRUE_WORDS = {"on", "1", "true", "yes", "y"}


def requested_backends(cmake_args: str) -> list[str]:
    """The GPU options CMAKE_ARGS turns on, in GPU_OPTIONS' order. A later -D
    of the same option wins, as in CMake."""
    values: dict[str, str] = {}
    words = shlex.split(cmake_args)
    for position, word in enumerate(words):
        if word == "-D" and position + 1 < len(words):
            word = "-D" + words[position + 1]
        if not word.startswith("-D") or "=" not in word:
            continue
        name, value = word[2:].split("=", 1)
        values[name.split(":", 1)[0]] = value  # -DGGML_CUDA:BOOL=ON
    return [
        option
        for option in GPU_OPTIONS
        if values.get(option, "").strip().lower() in TRUE_WORDS
    ]


def built_backends() -> tuple[list[str], bool]:
    """ggml's registered backends and whether llama.cpp can offload to a GPU,
    for the llama-cpp-python this interpreter imports."""
    import llama_cpp

    offload = bool(llama_cpp.llama_supports_gpu_offload())
    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so"))
    library.ggml_backend_reg_count.restype = ctypes.c_size_t
    library.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    library.ggml_backend_reg_get.restype = ctypes.c_void_p
    library.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    library.ggml_backend_reg_name.restype = ctypes.c_char_p
    names = [
        library.ggml_backend_reg_name(library.ggml_backend_reg_get(index)).decode()
        for index in range(library.ggml_backend_reg_count())
    ]
    return names, offload


def problem(cmake_args: str, built: list[str], offload: bool) -> str:
    """What is missing, in words; '' when the build has every backend it was
    asked for. A backend that is built but sees no card (no driver, a build
    host without a GPU) is not a problem of the build: `main` only warns."""
    have = {name.lower() for name in built}
    missing = [
        option
        for option in requested_backends(cmake_args)
        if not {name.lower() for name in GPU_OPTIONS[option]} & have
    ]
    if not missing:
        return ""
    asked = ", ".join(f"-D{option}=ON" for option in missing)
    return (
        f"llama-cpp-python was asked for {asked} (CMAKE_ARGS: {cmake_args}), "
        f"but the installed llama.cpp was built with the backends "
        f"{', '.join(built) or 'none'} (GPU offload: {'yes' if offload else 'no'}): "
        "models would run on the CPU only. Check that CMake finds the GPU "
        "toolkit (CUDA: nvcc on PATH or CUDACXX set; HIP: ROCm's hipcc; Vulkan: "
        "the Vulkan SDK and glslc), then run `make setup` again."
    )


def main(argv: list[str]) -> int:
    """Check the CMAKE_ARGS given as arguments against the installed build."""
    cmake_args = " ".join(argv[1:])
    if not requested_backends(cmake_args):
        return 0
    built, offload = built_backends()
    message = problem(cmake_args, built, offload)
    if message:
        print(f"error: {message}", file=sys.stderr)
        return 1
    print(f"llama.cpp backends: {', '.join(built)}")
    if not offload:
        print(
            "warning: llama.cpp has the GPU backend but sees no card now "
            "(driver, CUDA_VISIBLE_DEVICES?): models will run on the CPU until it does",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
