"""Reads of API keys, users' limits and usage."""

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django import db
from django.db.models import Count, QuerySet, Sum, Value
from django.db.models.functions import Coalesce

from catalog.models import ModelConfig

from .limits import Allowance
from .models import ApiKey, UserLimitOverride, UserLimits

P = ParamSpec("P")
R = TypeVar("R")


def in_db_thread(function: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """`function` as a coroutine run in asgiref's shared sync thread, after
    retiring that thread's database connection if it is broken or older than
    CONN_MAX_AGE. Django's handler does that on `request_started`, which the
    API's handler does not send (roundhouse.bare_handler.BareASGIHandler)."""

    def fresh(*args: P.args, **kwargs: P.kwargs) -> R:
        for connection in db.connections.all(initialized_only=True):
            if not connection.in_atomic_block:  # never inside a caller's transaction
                connection.close_if_unusable_or_obsolete()
        return function(*args, **kwargs)

    return sync_to_async(fresh, thread_sensitive=True)


def api_key_by_hash(*, key_hash: str) -> ApiKey | None:
    """The key with this hash, its allowed model names in `allowed_model_names`."""
    key = (
        ApiKey.objects.filter(key_hash=key_hash)
        .prefetch_related("allowed_models")
        .first()
    )
    if key is not None:
        key.allowed_model_names = frozenset(
            model.name for model in key.allowed_models.all()
        )
    return key


api_key_get_by_hash = in_db_thread(api_key_by_hash)


def api_keys_with_usage_totals(
    *, queryset: QuerySet[ApiKey] | None = None
) -> QuerySet[ApiKey]:
    """Keys annotated with their request count and prompt and completion tokens."""
    queryset = ApiKey.objects.all() if queryset is None else queryset
    # One multi-valued join (usage) only: the sums are not multiplied by another.
    return queryset.annotate(
        request_count=Count("usage"),
        prompt_tokens_total=Coalesce(Sum("usage__prompt_tokens"), Value(0)),
        completion_tokens_total=Coalesce(Sum("usage__completion_tokens"), Value(0)),
    )


def model_configs_by_name(*, names: Iterable[str]) -> dict[str, ModelConfig]:
    """The catalog models among these names, by name (unknown names are absent)."""
    return {model.name: model for model in ModelConfig.objects.filter(name__in=names)}


# A user's limits are read again at most this often: a change in the admin
# holds within seconds, and a chat message costs no query most of the time.
USER_LIMITS_FRESH_S = 5.0
_USER_LIMITS_KEPT = 10_000  # users remembered at most (then forgotten at once)
_user_allowances: dict[int, tuple[float, Allowance]] = {}


def user_allowance_remembered(*, user_id: int) -> Allowance | None:
    """A user's limits as read less than USER_LIMITS_FRESH_S ago (None:
    read them with user_allowance). Reads no database: callable from the
    event loop, so a chat message costs no thread hop most of the time."""
    found = _user_allowances.get(user_id)
    if found is not None and time.monotonic() - found[0] < USER_LIMITS_FRESH_S:
        return found[1]
    return None


def user_allowance(*, user_id: int) -> Allowance:
    """A logged-in user's limits across all their sockets: their override, or
    the defaults (UserLimits). Remembered for USER_LIMITS_FRESH_S; while the
    database fails, the last one read (db.Error when there is none)."""
    remembered = user_allowance_remembered(user_id=user_id)
    if remembered is not None:
        return remembered
    now = time.monotonic()
    found = _user_allowances.get(user_id)
    try:
        limits = (
            UserLimitOverride.objects.filter(user_id=user_id).first()
            or UserLimits.load()
        )
    except db.Error:
        if found is None:
            raise
        return found[1]
    allowance = Allowance(
        f"u{user_id}", limits.rpm_limit, limits.max_concurrent, who="your account"
    )
    if len(_user_allowances) >= _USER_LIMITS_KEPT:
        _user_allowances.clear()
    _user_allowances[user_id] = (now, allowance)
    return allowance


def user_allowances_forget() -> None:
    """Read every user's limits again on their next request (tests, and a
    change saved in the admin in this process)."""
    _user_allowances.clear()
