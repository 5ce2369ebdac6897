"""Who an Ollama call is, and its refusals in Ollama's shape.

A call sends an API key as elsewhere (`Authorization: Bearer`). Many tools
that speak Ollama's API cannot send one; for them
ROUNDHOUSE_OLLAMA_LOOPBACK_KEY names a real key (by its prefix or its name)
that a call with no Authorization header acts as, when it comes from this
host's loopback address and through no proxy (no Forwarded or
X-Forwarded-For header): its limits, its models and its usage rows apply.
Off (empty) by default; a call from any other address still needs a key."""

import ipaddress
import json
import time

from django.conf import settings
from django.db.models import Q
from django.http import HttpRequest, HttpResponse

from ... import errors
from ...models import ApiKey
from ...pipeline import authenticate
from ...selectors import in_db_thread

# How long the loopback key, as read, is used before it is read again (a
# revoked key stops working within this).
LOOPBACK_KEY_CACHE_S = 5.0
_loopback_cache: dict[str, tuple[ApiKey, float]] = {}


def refusal(error: errors.ApiError) -> HttpResponse:
    """An error as Ollama answers one: `{"error": "..."}`, the same status
    (and Retry-After)."""
    response = HttpResponse(
        json.dumps({"error": error.message}),
        status=error.status,
        content_type="application/json",
    )
    if error.retry_after_s is not None:
        response["Retry-After"] = str(error.retry_after_s)
    return response


def from_loopback(request: HttpRequest) -> bool:
    """Whether the call comes from this host, directly (a proxy on this host
    would make every caller look local: a forwarded call is not)."""
    if "Forwarded" in request.headers or "X-Forwarded-For" in request.headers:
        return False
    try:
        return ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "").is_loopback
    except ValueError:
        return False


async def ollama_key(request: HttpRequest) -> ApiKey:
    """The call's live key: its bearer key, or with none from loopback the
    key ROUNDHOUSE_OLLAMA_LOOPBACK_KEY names (when set); ApiError otherwise."""
    authorization = request.headers.get("Authorization")
    named = settings.ROUNDHOUSE_OLLAMA_LOOPBACK_KEY
    if not authorization and named and from_loopback(request):
        return await loopback_key(named)
    return await authenticate(
        authorization=authorization,
        client=request.META.get("REMOTE_ADDR") or "unknown",
    )


async def loopback_key(named: str) -> ApiKey:
    """The one live key whose prefix or name is `named` (read at most every
    LOOPBACK_KEY_CACHE_S); 401 when there is none, or several."""
    found = _loopback_cache.get(named)
    if found is not None and time.monotonic() - found[1] < LOOPBACK_KEY_CACHE_S:
        return found[0]
    keys = await in_db_thread(_live_keys_named)(named=named)
    if len(keys) != 1:
        how = "no live API key" if not keys else "several live API keys"
        raise errors.unauthorized(
            f"ROUNDHOUSE_OLLAMA_LOOPBACK_KEY names {how} ({named!r}); send an "
            "API key (Authorization: Bearer YOUR_KEY) or ask the administrator."
        )
    _loopback_cache[named] = (keys[0], time.monotonic())
    return keys[0]


def _live_keys_named(*, named: str) -> list[ApiKey]:
    keys = list(
        ApiKey.objects.filter(Q(prefix=named) | Q(name=named), revoked_at__isnull=True)
        .prefetch_related("allowed_models")
        .order_by("pk")[:2]
    )
    for key in keys:
        key.allowed_model_names = frozenset(m.name for m in key.allowed_models.all())
    return keys
