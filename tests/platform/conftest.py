"""Fixtures the platform's tests share across apps."""

import pytest

from batches import services
from tests.factories import ApiKeyFactory


@pytest.fixture
def batch(settings, tmp_path):
    """A batch of a thousand lines from a key of its own, its input file stored
    in the test's directory."""
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    key = ApiKeyFactory()
    stored = services.file_store(
        key=key, chunks=[b"{}\n" * 1000], filename="in.jsonl", purpose="batch"
    )
    return services.batch_create(
        key=key,
        input_file_id=stored.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )
