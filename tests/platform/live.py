"""Helpers for tests that run the platform's real processes (the supervisor, the
front) against the test database."""

import contextlib
import socket
import urllib.request

from django.db import connection

# The database name from the settings, read when the tests are collected (before
# any test database exists): once one is set up, the connection names another.
CONFIGURED_DATABASE = connection.settings_dict["NAME"]


def database_url() -> str:
    """The test database, as a child process must reach it."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def free_port_block(size: int = 4) -> int:
    """A base port with `size` free ports after it."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + size > 65535:
            continue
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port block")


def front_answers(port: int) -> bool:
    """Whether a front on this port answers /healthz with 200."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/healthz", timeout=5
        ) as reply:
            return reply.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def live_database(django_db_blocker):
    """Database access for fixtures that outlive one test, on the test database.

    pytest-django creates the test database only when some collected test asks
    for it (a `django_db` mark or a db fixture). Live-process tests must not:
    each test would run in a transaction the front's writes wait behind, or
    flush the rows the front and the supervisor are reading. Run alone, such a
    module sets the test database up itself."""
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        if connection.settings_dict["NAME"] != CONFIGURED_DATABASE:
            yield  # pytest-django has already switched to the test database
            return
        created = setup_databases(verbosity=0, interactive=False, aliases={"default"})
        try:
            yield
        finally:
            teardown_databases(created, verbosity=0)
