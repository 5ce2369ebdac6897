"""scripts/llama_backend_check.py: a build asked for a GPU backend that lacks it
fails with a message naming both; a build asked for none passes.

This machine's llama-cpp-python is a CPU build, so asking it for CUDA is the
real failing case; the passing GPU cases go through the pure functions with the
registry names ggml gives those backends."""

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "llama_backend_check.py"
CPU_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON"


def load_check():
    spec = importlib.util.spec_from_file_location("llama_backend_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = load_check()


def run(cmake_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), cmake_args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_cuda_asked_of_this_cpu_build_fails_naming_both():
    result = run(f"{CPU_ARGS} -DGGML_CUDA=ON")
    assert result.returncode == 1
    assert "asked for -DGGML_CUDA=ON" in result.stderr
    assert "built with the backends CPU (GPU offload: no)" in result.stderr


def test_nothing_asked_passes():
    """Control: the same build, asked for no GPU backend."""
    result = run(CPU_ARGS)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert run(f"{CPU_ARGS} -DGGML_CUDA=OFF").returncode == 0


@pytest.mark.parametrize(
    ("cmake_args", "asked"),
    [
        ("", []),
        ("-DGGML_CUDA=ON", ["GGML_CUDA"]),
        ("-DGGML_CUDA=on -DGGML_VULKAN=1", ["GGML_CUDA", "GGML_VULKAN"]),
        ("-D GGML_HIP=ON", ["GGML_HIP"]),
        ("-DGGML_CUDA:BOOL=TRUE", ["GGML_CUDA"]),
        ("-DGGML_CUDA=ON -DGGML_CUDA=OFF", []),  # the later one wins, as in CMake
        ("-DGGML_CUDA_F16=ON -DGGML_NATIVE=ON", []),
    ],
)
def test_requested_backends(cmake_args, asked):
    assert check.requested_backends(cmake_args) == asked


@pytest.mark.parametrize(
    ("cmake_args", "built"),
    [
        ("-DGGML_CUDA=ON", ["CPU", "CUDA"]),
        ("-DGGML_HIP=ON", ["CPU", "ROCm"]),
        ("-DGGML_VULKAN=ON", ["Vulkan", "CPU"]),
    ],
)
def test_a_build_with_the_backend_asked_passes(cmake_args, built):
    assert check.problem(cmake_args, built, offload=True) == ""
    # A build host that sees no card still has the backend.
    assert check.problem(cmake_args, built, offload=False) == ""


def test_a_build_with_another_backend_fails():
    message = check.problem("-DGGML_CUDA=ON -DGGML_VULKAN=ON", ["CPU", "Vulkan"], True)
    assert "asked for -DGGML_CUDA=ON (CMAKE_ARGS" in message  # not Vulkan: it is there
    assert "built with the backends CPU, Vulkan (GPU offload: yes)" in message
