"""Usage rows: building one request's row, and writing rows in the background.

The API only enqueues a request's row (`usage_enqueue`); one `UsageWriter`
thread writes them, many per INSERT, and `usage_flush` writes what is queued
when the process stops.
"""

import atexit
import contextlib
import logging
import queue
import threading
import time

from django import db

from . import metrics
from .models import ApiKey, Usage
from .parts import Part

__all__ = [
    "usage_writer",
    "UsageWriter",
    "usage_build",
    "usage_enqueue",
    "usage_flush",
]

log = logging.getLogger("roundhouse.api")


def usage_build(
    *,
    key: ApiKey | None,
    user=None,
    model: str,
    engine: str,
    endpoint: str,
    prompt_tokens: int,
    node: str = "",
    completion_tokens: int,
    latency_ms: float,
    status: int,
    error_code: str = "",
    cached_tokens: int = 0,
) -> Usage:
    """One request's usage row, checked and not yet saved."""
    usage = Usage(
        key=key,
        user=user,
        # Clients choose the model name; an over-long one is cut, not refused.
        model=model[: Usage._meta.get_field("model").max_length],
        engine=engine[: Usage._meta.get_field("engine").max_length],
        node=node[: Usage._meta.get_field("node").max_length],
        endpoint=endpoint,
        prompt_tokens=prompt_tokens or 0,
        completion_tokens=completion_tokens or 0,
        cached_tokens=cached_tokens or 0,
        latency_ms=latency_ms,
        status=status,
        error_code=error_code[: Usage._meta.get_field("error_code").max_length],
    )
    # The key came from api_key_authenticate, the user from the session:
    # checking that they exist would cost a query on every request.
    usage.full_clean(exclude=["key", "user"])
    return usage


class UsageWriter:
    """Writes usage rows from one background thread, many per INSERT.

    The API only enqueues a request's row: no thread hop and no database
    connection on a request's path (an ASGI request's ORM work gets a new thread
    and connection each time). Nothing is lost silently:

    - At most MAX_QUEUED rows wait; a row past that is dropped and counted.
    - A batch the database fails (connection lost, database locked or
      restarting: DatabaseError) is tried again after each of RETRY_DELAYS_S
      (about a minute in all, while new rows queue), then dropped and counted.
    - A batch the database refuses for one of its rows (IntegrityError,
      DataError) is written row by row: only the rows refused are dropped.
    - Rows queued when the process stops are written first: `close` runs on
      the ASGI lifespan's shutdown (uvicorn, after SIGTERM) and at exit.

    Dropped rows are counted in `roundhouse_usage_rows_dropped_total` and
    logged; failed writes in `roundhouse_usage_write_failures_total`.
    """

    BATCH = 500
    # After the first row of a batch, the writer waits this long for more: rows
    # queued meanwhile wake no thread (waking one costs the event loop 0.1-0.2
    # ms of CPU on a small VM, for every request).
    LINGER_S = 0.25
    # About 20 s of a busy front's rows at 2,500 requests a second.
    MAX_QUEUED = 50_000
    RETRY_DELAYS_S: tuple[float, ...] = (0.5, 1, 2, 4, 8, 15, 30)

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Usage | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, usage: Usage) -> None:
        """Queue one row for writing (dropped and counted when MAX_QUEUED wait)."""
        if self._queue.qsize() >= self.MAX_QUEUED:
            self._dropped(1, "queue_full")
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="usage-writer", daemon=True
                    )
                    self._thread.start()
        self._queue.put(usage)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread."""
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
            if thread.is_alive():
                log.error(
                    "the usage writer did not finish in %g s: %d queued usage "
                    "rows are not written yet",
                    timeout,
                    self._queue.qsize(),
                )

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            if batch[0] is not None:
                time.sleep(self.LINGER_S)
            while len(batch) < self.BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = None in batch
            rows = [row for row in batch if row is not None]
            if rows:
                try:
                    self._write(rows)
                except Exception:  # a bug: trying again would fail again
                    log.exception("could not record %d usage rows", len(rows))
                    self._dropped(len(rows), "error")
        db.connections.close_all()  # this thread's own connections
        with self._lock:
            self._thread = None

    def _write(self, rows: list[Usage]) -> None:
        """Write a batch, trying again while the database fails."""
        for delay in (*self.RETRY_DELAYS_S, None):
            try:
                self._insert(rows)
                return
            except (db.IntegrityError, db.DataError):
                self._write_each(rows)
                return
            except db.DatabaseError as error:
                metrics.USAGE_WRITE_FAILURES.inc()
                self._reconnect()
                if delay is None:
                    log.error("could not record %d usage rows: %s", len(rows), error)
                    self._dropped(len(rows), "database_error")
                    return
                log.warning(
                    "could not record %d usage rows, trying again in %g s: %s",
                    len(rows),
                    delay,
                    error,
                )
                time.sleep(delay)

    def _write_each(self, rows: list[Usage]) -> None:
        """Write rows one by one, dropping only those the database refuses."""
        for index, row in enumerate(rows):
            try:
                self._insert([row])
            except (db.IntegrityError, db.DataError) as error:
                log.warning("the database refused a usage row: %s", error)
                self._dropped(1, "refused")
            except db.DatabaseError:
                self._write(rows[index:])  # the database itself failed
                return

    def _insert(self, rows: list[Usage]) -> None:
        """The one write: one INSERT of these rows."""
        Usage.objects.bulk_create(rows)

    def _reconnect(self) -> None:
        """Drop this thread's connection: the next try opens a new one."""
        with contextlib.suppress(db.DatabaseError):
            db.connection.close()

    @staticmethod
    def _dropped(count: int, reason: str) -> None:
        metrics.USAGE_ROWS_DROPPED.labels(reason).inc(count)


def _usage_writer_start() -> UsageWriter:
    writer = UsageWriter()
    atexit.register(writer.close)
    return writer


# The process's usage writer (api.parts): built when the front or a worker
# starts, never at import.
usage_writer: Part[UsageWriter] = Part(_usage_writer_start)


def usage_enqueue(**fields) -> None:
    """Record one request's usage in the background (fields as `usage_build`)."""
    usage_writer().put(usage_build(**fields))


def usage_flush() -> None:
    """Write the usage rows queued so far (blocks: call it from a thread)."""
    writer = usage_writer.built()
    if writer is not None:
        writer.close()
