"""Reads of API keys and usage."""

from collections.abc import Iterable

from django.db.models import Count, QuerySet, Sum, Value
from django.db.models.functions import Coalesce

from catalog.models import ModelConfig

from .models import ApiKey


async def api_key_get_by_hash(*, key_hash: str) -> ApiKey | None:
    """The key with this hash, its allowed model names in `allowed_model_names`."""
    key = (
        await ApiKey.objects.filter(key_hash=key_hash)
        .prefetch_related("allowed_models")
        .afirst()
    )
    if key is not None:
        # Read from the prefetched rows: no query, so safe on the event loop.
        key.allowed_model_names = frozenset(
            model.name for model in key.allowed_models.all()
        )
    return key


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
