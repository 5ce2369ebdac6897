"""The API's database calls keep their thread's connection healthy themselves:
the API's handler sends no request_started, whose receiver does that for the
rest of Django."""

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.db.backends.signals import connection_created

from api.models import ApiKey
from api.selectors import in_db_thread

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def connects():
    """How many database connections were opened, in any thread."""
    opened = []

    def count(sender, connection, **kwargs):
        opened.append(connection.alias)

    connection_created.connect(count)
    yield opened
    connection_created.disconnect(count)


def query() -> bool:
    return ApiKey.objects.exists()


def obsolete() -> None:
    """Mark this thread's connection as past CONN_MAX_AGE."""
    connection.ensure_connection()
    connection.close_at = 0


async def test_an_obsolete_connection_is_retired_before_the_next_call(connects):
    await in_db_thread(query)()
    await sync_to_async(obsolete)()
    opened = len(connects)
    await in_db_thread(query)()
    assert len(connects) == opened + 1  # retired, then a fresh one


async def test_without_it_the_obsolete_connection_stays(connects):
    """The control: the same calls through plain sync_to_async reuse it."""
    await sync_to_async(query)()
    await sync_to_async(obsolete)()
    opened = len(connects)
    await sync_to_async(query)()
    assert len(connects) == opened
