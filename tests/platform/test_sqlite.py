"""The embedded SQLite database runs with a write-ahead log, and a transaction
that reads before it writes waits for another process's writer."""

import sqlite3
import threading
from collections.abc import Callable

import pytest
from django.contrib.auth.models import Group
from django.db import connection, connections, transaction


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


def race(transaction_of_a: Callable[[Callable[[], None]], None]) -> str:
    """A reads, B commits a write meanwhile, A writes (a quota check, another
    upload, an insert): what A's write got, "ok" or the error. A waits for
    B's commit at most 2 s: B never commits first when A holds the lock."""
    a_read, b_committed = threading.Event(), threading.Event()
    outcome: list[str] = []

    def in_a_transaction() -> None:
        a_read.set()
        b_committed.wait(2)

    def a() -> None:
        try:
            transaction_of_a(in_a_transaction)
            outcome.append("ok")
        except Exception as error:  # noqa: BLE001 - the outcome is the test's
            outcome.append(f"{type(error).__name__}: {error}")
        finally:
            a_read.set()

    def b() -> None:
        a_read.wait(30)
        try:
            Group.objects.create(name="written by b")
            b_committed.set()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcome[0]


@pytest.mark.django_db(transaction=True)
def test_a_transaction_that_reads_then_writes_waits_for_another_writer():
    """Transactions begin IMMEDIATE: the other writer waits for this one,
    instead of this one's write failing at once with "database is locked"
    (which the API answered as a 503). Control: the same race with a deferred
    transaction on the same file fails."""
    if connection.vendor != "sqlite":
        pytest.skip("the settings apply to SQLite only")
    path = connection.settings_dict["NAME"]

    def django_transaction(meanwhile: Callable[[], None]) -> None:
        try:
            with transaction.atomic():
                Group.objects.count()
                meanwhile()
                Group.objects.create(name="written by a")
        finally:
            connections.close_all()

    def deferred_transaction(meanwhile: Callable[[], None]) -> None:
        raw = sqlite3.connect(path, timeout=20, isolation_level=None)
        try:
            raw.execute("BEGIN")
            raw.execute("SELECT count(*) FROM auth_group").fetchone()
            meanwhile()
            raw.execute("INSERT INTO auth_group (name) VALUES ('written by a')")
            raw.execute("COMMIT")
        finally:
            raw.close()

    assert race(deferred_transaction) == "OperationalError: database is locked"
    Group.objects.all().delete()
    assert race(django_transaction) == "ok"
    assert set(Group.objects.values_list("name", flat=True)) == {
        "written by a",
        "written by b",
    }
