"""Usage rows: one per request, queued by the views and written in batches by
the background writer, which loses none to a database that fails for a moment."""

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from api import metrics
from api.models import ApiKey, Usage
from api.usage import UsageWriter, usage_build, usage_enqueue, usage_writer
from tests.factories import ApiKeyFactory
from tests.platform.api.usage_lock import usage_table_locked
from tests.waiting import wait_for

transactional = pytest.mark.django_db(transaction=True)


def record(**fields) -> None:
    """Queue one row as a view does, then wait until the writer has stored it."""
    usage_enqueue(
        **{
            "key": None,
            "model": "m",
            "engine": "cpu0",
            "endpoint": "chat.completions",
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "latency_ms": 1,
            "status": 200,
            **fields,
        }
    )
    usage_writer().close()  # writes what is queued, then stops (the next put restarts)


@transactional
def test_usage_stores_one_row():
    """A request's key, model, engine, tokens, latency and outcome become one row."""
    key = ApiKeyFactory()
    record(
        key=key,
        model="gemma-3-270m",
        prompt_tokens=12,
        completion_tokens=34,
        latency_ms=56.5,
    )
    stored = Usage.objects.select_related("key").get()
    assert stored.key.pk == key.pk
    assert (stored.model, stored.engine, stored.endpoint) == (
        "gemma-3-270m",
        "cpu0",
        "chat.completions",
    )
    assert (stored.prompt_tokens, stored.completion_tokens) == (12, 34)
    assert (stored.latency_ms, stored.status, stored.error_code) == (56.5, 200, "")
    assert stored.created_at is not None


@transactional
def test_refused_request_is_recorded():
    """A refused request is a row too: its status and error code, no tokens; the
    model may be unknown, empty or over-long (cut, not refused)."""
    key = ApiKeyFactory()
    for model in ("", "x" * 500):
        record(
            key=key,
            model=model,
            engine="",
            endpoint="embeddings",
            status=429,
            error_code="rate_limit_exceeded",
        )
    models = list(Usage.objects.order_by("pk").values_list("model", flat=True))
    assert models == ["", "x" * 128]
    assert Usage.objects.filter(status=429, error_code__gt="").count() == 2


@transactional
def test_unknown_endpoint_is_a_programming_error():
    """An endpoint outside the known ones is refused before it is queued."""
    with pytest.raises(ValidationError):
        record(endpoint="chat")
    assert not Usage.objects.exists()


@transactional
def test_rows_queued_together_are_written_together():
    """Rows queued in a burst are all stored, whatever batches the writer takes."""
    for status in (200, 429, 499):
        usage_enqueue(
            key=None,
            model="m",
            engine="cpu0",
            endpoint="completions",
            prompt_tokens=1,
            completion_tokens=1,
            latency_ms=1,
            status=status,
        )
    usage_writer().close()
    assert sorted(Usage.objects.values_list("status", flat=True)) == [200, 429, 499]


# -- nothing is lost: a database that fails for a moment ----------------------


def sample(name: str, **labels) -> float:
    """A value of the front's metrics, as /metrics shows it."""
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def dropped(reason: str) -> float:
    return sample("roundhouse_usage_rows_dropped_total", reason=reason)


def failures() -> float:
    return sample("roundhouse_usage_write_failures_total")


@pytest.fixture
def impatient_writer(monkeypatch):
    """A usage writer whose connection (its thread's own, opened after this)
    gives up waiting for a lock at once: the configured one waits 20 s, then
    fails."""
    options = connection.settings_dict["OPTIONS"]
    if connection.vendor == "sqlite":
        monkeypatch.setitem(options, "timeout", 0.05)
    else:
        monkeypatch.setitem(options, "options", "-c lock_timeout=50")
    writer = UsageWriter()
    writer.LINGER_S = 0
    writer.RETRY_DELAYS_S = (0.02,) * 5000  # until the test lets it write
    yield writer
    writer.close()


def row(model: str) -> Usage:
    return usage_build(
        key=None,
        model=model,
        engine="cpu0",
        endpoint="completions",
        prompt_tokens=1,
        completion_tokens=1,
        latency_ms=1,
        status=200,
    )


def stored() -> list[str]:
    return list(Usage.objects.order_by("pk").values_list("model", flat=True))


@transactional
def test_rows_survive_a_database_that_fails_for_a_moment(impatient_writer):
    """A write that fails (the table locked: a real OperationalError) is tried
    again until it succeeds: the row is stored, nothing dropped."""
    before, lost = failures(), dropped("database_error")
    with usage_table_locked():
        impatient_writer.put(row("during the hiccup"))
        wait_for(lambda: failures() >= before + 2, what="two failed writes")
    impatient_writer.close()
    assert stored() == ["during the hiccup"]
    assert dropped("database_error") == lost


@transactional
def test_the_queue_is_bounded_and_rows_over_it_are_counted(impatient_writer):
    """While the writer retries, at most MAX_QUEUED rows wait; the rest are
    dropped and counted. The waiting ones are written once it can."""
    impatient_writer.MAX_QUEUED = 2
    before, full = failures(), dropped("queue_full")
    with usage_table_locked():
        impatient_writer.put(row("r1"))
        wait_for(lambda: failures() > before, what="a failed write")  # r1 is taken
        for name in ("r2", "r3", "r4", "r5"):
            impatient_writer.put(row(name))
    impatient_writer.close()
    assert stored() == ["r1", "r2", "r3"]
    assert dropped("queue_full") == full + 2


@transactional
def test_rows_still_failing_after_the_retries_are_counted(impatient_writer):
    """A batch the database keeps failing is dropped after the last retry, and
    its rows are counted; the writer goes on with the next."""
    impatient_writer.RETRY_DELAYS_S = (0.01, 0.01)
    lost = dropped("database_error")
    with usage_table_locked():
        impatient_writer.put(row("lost"))
        wait_for(lambda: dropped("database_error") == lost + 1, what="the row dropped")
    impatient_writer.put(row("after"))
    impatient_writer.close()
    assert stored() == ["after"]


@transactional
def test_a_row_the_database_refuses_does_not_take_its_batch_with_it():
    """A row of a key deleted meanwhile (by another process) breaks its
    foreign key: the batch is written row by row, and only that row is dropped
    (and counted)."""
    writer = UsageWriter()
    refused = dropped("refused")
    ghost = ApiKeyFactory()
    ghost_row = usage_build(
        key=ghost,
        model="ghost",
        engine="cpu0",
        endpoint="completions",
        prompt_tokens=1,
        completion_tokens=1,
        latency_ms=1,
        status=200,
    )
    ApiKey.objects.filter(pk=ghost.pk).delete()  # as the admin, elsewhere
    for usage in (row("before"), ghost_row, row("after")):
        writer.put(usage)
    writer.close()
    assert stored() == ["before", "after"]
    assert dropped("refused") == refused + 1


def test_metrics_show_the_usage_counters():
    """/metrics exposes the dropped rows by reason from the start, at 0."""
    text = metrics.exposition().decode()
    for reason in ("queue_full", "database_error", "refused"):
        assert f'roundhouse_usage_rows_dropped_total{{reason="{reason}"}}' in text
    assert "roundhouse_usage_write_failures_total" in text
