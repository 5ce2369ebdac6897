"""The usage table locked in the real database, as the tests of the usage
writer's retries and of the front's shutdown hold it."""

import contextlib

from django.db import connection, transaction

from api.models import Usage


@contextlib.contextmanager
def usage_table_locked():
    """Hold the write lock on the usage table: a real lock in the real
    database, which other connections' INSERTs wait for, then fail on."""
    with transaction.atomic():
        if connection.vendor == "sqlite":
            # The first write of a transaction takes the database's write lock.
            Usage.objects.filter(pk=-1).update(status=0)
            Usage.objects.create(model="lock", endpoint="embeddings", status=0)
        else:
            with connection.cursor() as cursor:
                table = Usage._meta.db_table
                cursor.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
        yield
        transaction.set_rollback(True)
