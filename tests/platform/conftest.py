"""Fixtures the platform's tests share across apps."""

import contextlib

import pytest

from api.gateway import Gateway, front_gateway
from api.usage import usage_writer
from batches import services
from tests.factories import ApiKeyFactory


@pytest.fixture(autouse=True)
def usage_rows_written(request):
    """A test's queued usage rows are written before its database is emptied:
    the usage writer's thread inserts them up to a quarter of a second after a
    request ends, and on PostgreSQL that INSERT (its key's foreign-key lock)
    beside the flush's TRUNCATE of a transactional test deadlocked once in CI.
    Set up after the database fixture, so torn down before it."""
    if request.node.get_closest_marker("django_db") is not None:
        request.getfixturevalue("_django_db_helper")
    yield
    usage_writer().close()  # the next row queued starts the writer again


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


@pytest.fixture
def own_gateway():
    """Install a gateway of the test's own: `own_gateway(load, **options)`
    (Gateway's arguments: where its routing snapshots come from, their max
    age, the clock) builds one, which every request uses until the test ends;
    then the one before is back."""
    with contextlib.ExitStack() as stack:

        def install(*args, **options) -> Gateway:
            gateway = stack.enter_context(
                front_gateway.installed(Gateway(*args, **options))
            )
            stack.callback(gateway.shutdown)
            return gateway

        yield install
