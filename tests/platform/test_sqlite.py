"""The embedded SQLite database runs with a write-ahead log."""

import pytest
from django.db import connection


@pytest.mark.django_db
def test_sqlite_uses_a_write_ahead_log_without_a_sync_per_commit():
    """Readers and the writer do not block each other, and a commit (a usage
    row, the supervisor's state) does not sync the disk: synchronous=NORMAL."""
    if connection.vendor != "sqlite":
        pytest.skip("the settings apply to SQLite only")
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        assert cursor.fetchone()[0] == "wal"
        cursor.execute("PRAGMA synchronous")
        assert cursor.fetchone()[0] == 1  # NORMAL (FULL, the default, is 2)
