"""Usage rows: one per request, written from async views."""

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ValidationError

from api.models import Usage
from api.services import usage_record
from tests.factories import ApiKeyFactory

transactional = pytest.mark.django_db(transaction=True)


@transactional
async def test_usage_record_stores_one_row():
    """A request's key, model, engine, tokens, latency and outcome become one row."""
    key = await sync_to_async(ApiKeyFactory)()
    usage = await usage_record(
        key=key,
        model="gemma-3-270m",
        engine="cpu0",
        endpoint="chat.completions",
        prompt_tokens=12,
        completion_tokens=34,
        latency_ms=56.5,
        status=200,
    )
    stored = await Usage.objects.select_related("key").aget()
    assert stored.pk == usage.pk
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
async def test_refused_request_is_recorded():
    """A refused request is a row too: its status and error code, no tokens; the
    model may be unknown, empty or over-long (cut, not refused)."""
    key = await sync_to_async(ApiKeyFactory)()
    for model in ("", "x" * 500):
        await usage_record(
            key=key,
            model=model,
            engine="",
            endpoint="embeddings",
            prompt_tokens=0,
            completion_tokens=0,
            latency_ms=1,
            status=429,
            error_code="rate_limit_exceeded",
        )
    models = [usage.model async for usage in Usage.objects.order_by("pk")]
    assert models == ["", "x" * 128]
    assert await Usage.objects.filter(status=429, error_code__gt="").acount() == 2


@transactional
async def test_unknown_endpoint_is_a_programming_error():
    """An endpoint outside the known ones is refused before it is stored."""
    with pytest.raises(ValidationError):
        await usage_record(
            key=None,
            model="m",
            engine="cpu0",
            endpoint="chat",
            prompt_tokens=0,
            completion_tokens=0,
            latency_ms=1,
            status=200,
        )
    assert not await Usage.objects.aexists()
