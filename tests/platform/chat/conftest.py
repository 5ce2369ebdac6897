"""The chat tests' engine and sockets, and the API tests' clean slate (limit
counters, remembered keys, worker threads' database connections), which the
WebSocket chat shares with REST."""

import asyncio

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connections

from tests.platform.api.chat_front import chat_engine, routed_to
from tests.platform.api.clean_slate import close_background_connections, front_forget


@pytest.fixture(autouse=True)
def empty_cache():
    """No counter, key, outage or fleet view of an earlier test (the API
    tests' clean slate: the chat shares the front with REST)."""
    front_forget()
    yield
    front_forget()


@pytest.fixture(autouse=True)
def close_worker_connections():
    """Close the connections a test opened in other threads (asgiref's shared
    sync thread: database_sync_to_async; the usage writer; the snapshot
    loader): left open, PostgreSQL refuses to drop the test database. Not
    under a running event loop: Playwright's sync API runs one in the browser
    tests' thread, whose platform runs in processes of its own."""
    yield
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        async_to_sync(sync_to_async(connections.close_all))()
        close_background_connections()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A real engine serving SmolLM2 with one slot (a second stream waits)."""
    engine = chat_engine(tmp_path_factory.mktemp("chat"))
    yield engine
    engine.stop()


@pytest.fixture
def socket_app(engine, tmp_path, settings, own_gateway):
    """The front's WebSocket application, its streams routed to `engine`."""
    routed_to(engine, tmp_path, settings, own_gateway)
    from roundhouse.asgi import websocket_application

    return websocket_application
