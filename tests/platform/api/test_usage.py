"""Usage rows: one per request, queued by the views and written in batches by
the background writer."""

import pytest
from django.core.exceptions import ValidationError

from api.models import Usage
from api.services import USAGE_WRITER, usage_enqueue
from tests.factories import ApiKeyFactory

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
    USAGE_WRITER.close()  # writes what is queued, then stops (the next put restarts)


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
    USAGE_WRITER.close()
    assert sorted(Usage.objects.values_list("status", flat=True)) == [200, 429, 499]
