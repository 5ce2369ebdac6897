"""Conversations in the admin: browsed and deleted, never edited (they are a
record of what was said and answered)."""

from django.contrib import admin
from django.db.models import Count
from django.http import HttpRequest

from .models import Conversation, Message


class MessageInline(admin.TabularInline):
    model = Message
    extra = 0
    can_delete = False
    fields = [
        "created_at",
        "role",
        "content",
        "engine",
        "finish_reason",
        "error_code",
        "prompt_tokens",
        "completion_tokens",
        "first_token_ms",
        "total_ms",
        "turn_id",
    ]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ["__str__", "user", "key", "model", "updated_at", "message_count"]
    list_filter = ["model", "user", "key"]
    list_select_related = ["user", "key"]
    search_fields = ["title", "messages__content"]
    date_hierarchy = "updated_at"
    readonly_fields = [
        "user",
        "key",
        "model",
        "title",
        "system_prompt",
        "created_at",
        "updated_at",
    ]
    inlines = [MessageInline]

    def get_queryset(self, request: HttpRequest):
        return super().get_queryset(request).annotate(n_messages=Count("messages"))

    @admin.display(description="messages", ordering="n_messages")
    def message_count(self, obj: Conversation) -> int:
        return obj.n_messages

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: Conversation | None = None
    ) -> bool:
        return False
