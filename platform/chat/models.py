"""Conversations held over the WebSocket chat, and their messages: whose each
is (a logged-in user, or an API key), which model and engine answered, with
its usage, timings and finish reason. Browsable in the admin; a user's chat
page lists only their own (chat.selectors)."""

from django.conf import settings
from django.db import models
from django.db.models import Q


class Conversation(models.Model):
    """One chat with one model; it belongs to a user or to an API key."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="conversations",
    )
    key = models.ForeignKey(
        "api.ApiKey",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="conversations",
        verbose_name="API key",
    )
    model = models.CharField(max_length=200)
    title = models.CharField(max_length=200, blank=True)
    system_prompt = models.TextField(blank=True)
    # The client's id of the turn that started it (chat.schemas.TurnId):
    # a resend of that turn finds it rather than starting another.
    opening_turn = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        ordering = ["-updated_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(user__isnull=False) | Q(key__isnull=False),
                name="conversation_has_an_owner",
            ),
            # One conversation per owner and opening turn, whatever the
            # records that race to store it (chat.services).
            models.UniqueConstraint(
                fields=["user", "opening_turn"],
                condition=Q(user__isnull=False) & ~Q(opening_turn=""),
                name="conversation_opening_turn_once_per_user",
            ),
            models.UniqueConstraint(
                fields=["key", "opening_turn"],
                condition=Q(user__isnull=True) & ~Q(opening_turn=""),
                name="conversation_opening_turn_once_per_key",
            ),
        ]

    def __str__(self) -> str:
        return self.title or f"Conversation {self.pk} with {self.model}"


class Message(models.Model):
    """One turn. An assistant's answer records the engine's account of it."""

    class Role(models.TextChoices):
        SYSTEM = "system"
        USER = "user"
        ASSISTANT = "assistant"

    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="messages"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField(blank=True)
    # An assistant's answer: which model and engine, how it ended (stop,
    # length, cancelled; empty with an error code when it failed).
    model = models.CharField(max_length=200, blank=True)
    engine = models.CharField(max_length=100, blank=True)
    finish_reason = models.CharField(max_length=32, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    first_token_ms = models.FloatField(null=True, blank=True)
    total_ms = models.FloatField(null=True, blank=True)
    # An answer: the client's id of the turn it answers (chat.schemas.TurnId),
    # empty when it sent none. A turn is answered once per conversation: its
    # resend replaces the answer (chat.services).
    turn_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["conversation", "turn_id"],
                condition=~Q(turn_id=""),
                name="message_turn_answered_once",
            )
        ]

    def __str__(self) -> str:
        return f"{self.role}: {self.content[:60]}"
