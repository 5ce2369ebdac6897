"""Admin for API keys, their usage and their stored responses."""

from datetime import datetime

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from fleet.admin import SingletonAdmin

from .dialects.responses_store import (
    stored_response_expires_at,
    stored_responses_listed,
)
from .models import ApiKey, StoredResponse, Usage, UserLimitOverride, UserLimits
from .selectors import api_keys_with_usage_totals, user_allowances_forget
from .services import api_key_issue, api_key_revoke


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "owner",
        "display_prefix",
        "created_at",
        "last_used_at",
        "is_revoked",
        "rpm_limit",
        "max_concurrent",
        "manages_models",
        "request_count",
        "prompt_tokens_total",
        "completion_tokens_total",
    ]
    list_filter = [
        ("revoked_at", admin.EmptyFieldListFilter),
        "manages_models",
        "owner",
    ]
    search_fields = ["name", "prefix", "owner__username"]
    list_select_related = ["owner"]
    filter_horizontal = ["allowed_models"]
    actions = ["revoke_keys"]
    # The hash is never shown: it is not secret, but nothing can be done with it.
    fields = [
        "name",
        "owner",
        "allowed_models",
        "rpm_limit",
        "max_concurrent",
        "manages_models",
        "display_prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    readonly_fields = ["display_prefix", "created_at", "last_used_at", "revoked_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiKey]:
        return api_keys_with_usage_totals(queryset=super().get_queryset(request))

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list:
        if obj is None:
            # Nothing to show before the key exists; the key itself is generated.
            return [name for name in self.fields if name not in self.readonly_fields]
        return self.fields

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        plaintext = api_key_issue(key=obj)
        # Shown this once, in the message; it is stored nowhere.
        self.message_user(
            request,
            format_html(
                "The new API key is <code>{}</code>. Copy it now: it will not be "
                "shown again.",
                plaintext,
            ),
            messages.WARNING,
        )

    @admin.display(description="key", ordering="prefix")
    def display_prefix(self, key: ApiKey) -> str:
        return f"{key.prefix}…"

    @admin.display(description="revoked", boolean=True, ordering="revoked_at")
    def is_revoked(self, key: ApiKey) -> bool:
        return key.revoked

    @admin.display(description="requests", ordering="request_count")
    def request_count(self, key: ApiKey) -> int:
        return key.request_count

    @admin.display(description="prompt tokens", ordering="prompt_tokens_total")
    def prompt_tokens_total(self, key: ApiKey) -> int:
        return key.prompt_tokens_total

    @admin.display(description="completion tokens", ordering="completion_tokens_total")
    def completion_tokens_total(self, key: ApiKey) -> int:
        return key.completion_tokens_total

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        revoked = 0
        for key in queryset.filter(revoked_at__isnull=True):
            api_key_revoke(key=key)
            self.log_change(request, key, "Revoked.")
            revoked += 1
        self.message_user(request, f"Revoked {revoked} key(s).", messages.SUCCESS)


@admin.register(Usage)
class UsageAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "key",
        "user",
        "endpoint",
        "model",
        "node",
        "engine",
        "status",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "latency_ms",
        "error_code",
    ]
    list_filter = ["key", "model", "node", "engine", "status", "endpoint"]
    list_select_related = ["key", "user"]
    date_hierarchy = "created_at"
    # Usage grows with every request: skip counting the whole table per page.
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: Usage | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: Usage | None = None
    ) -> bool:
        return False


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    """Stored Responses answers, listed to be seen and deleted; never written
    here. What they say stays their owner's: neither the list nor a row's page
    shows the answer, its items or the conversation, only their size."""

    list_display = ["id", "owner", "model", "status", "created_at", "expires_at"]
    fields = [
        "id",
        "key",
        "user",
        "model",
        "status",
        "size_bytes",
        "created_at",
        "expires_at",
    ]
    readonly_fields = fields
    search_fields = ["id", "model"]
    list_select_related = ["key", "user"]
    date_hierarchy = "created_at"
    # Every stored turn is a row: skip counting the whole table per page.
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[StoredResponse]:
        return stored_responses_listed(super().get_queryset(request))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: StoredResponse | None = None
    ) -> bool:
        return False

    @admin.display(description="owner")
    def owner(self, stored: StoredResponse) -> str:
        return str(stored.key or stored.user)

    @admin.display(description="status")
    def status(self, stored: StoredResponse) -> str:
        return stored.status or ""

    @admin.display(description="expires")
    def expires_at(self, stored: StoredResponse) -> datetime | str:
        return stored_response_expires_at(stored) or "never"


class UserLimitOverrideInline(admin.TabularInline):
    model = UserLimitOverride
    extra = 0
    autocomplete_fields = ["user"]
    verbose_name_plural = "users with their own limits"


@admin.register(UserLimits)
class UserLimitsAdmin(SingletonAdmin):
    """Limits of logged-in users' chat: every user's, and some users' own."""

    inlines = [UserLimitOverrideInline]
    fields = ["rpm_limit", "max_concurrent"]

    def save_related(self, request, form, formsets, change) -> None:
        super().save_related(request, form, formsets, change)
        user_allowances_forget()  # this process at once; the others within seconds
