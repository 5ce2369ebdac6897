"""The engine the node-link tests link to."""

import pytest

from tests.engines.conftest import start_engine
from tests.engines.generating import SMOL, gguf_spec


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """SmolLM2 (two slots) on a real engine, one per test module."""
    process = start_engine(
        tmp_path_factory.mktemp("link"),
        models=[gguf_spec(SMOL, "SmolLM2-135M-Instruct.Q4_1.gguf", slots=2)],
        preload=[SMOL],
    )
    yield process
    process.stop()
