"""Shared test set-up: paths of the repository and the bundled models."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, *, env: dict | None = None, timeout: float = 120):
    """Run code in a fresh interpreter with the project on sys.path."""
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def models_dir(settings) -> Path:
    """The models directory, with the bundled models installed by `make test`."""
    path = Path(settings.MODELS_DIR)
    if not (path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists():
        pytest.fail(f"bundled models missing in {path}: run `make test`")
    return path
