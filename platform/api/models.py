"""API keys of the OpenAI-compatible API, the limits of logged-in users, and
one usage row per request."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from fleet.models import SingletonModel


class ApiKey(models.Model):
    """A bearer key for the API; only its SHA-256 and a display prefix are stored."""

    name = models.CharField(max_length=100)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="api_keys",
    )
    prefix = models.CharField(
        max_length=16,
        editable=False,
        help_text="The key's first characters, to recognise it; not a secret.",
    )
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    allowed_models = models.ManyToManyField(
        "catalog.ModelConfig",
        blank=True,
        related_name="api_keys",
        help_text="Models this key may use. None selected: every model.",
    )
    rpm_limit = models.PositiveIntegerField(
        "requests per minute",
        default=0,
        help_text="Requests per minute for this key. 0: unlimited.",
    )
    max_concurrent = models.PositiveIntegerField(
        "max concurrent requests",
        default=0,
        help_text="Requests of this key in flight at once. 0: unlimited.",
    )
    manages_models = models.BooleanField(
        default=False,
        help_text="May pull and delete models (the /v1/pulls and DELETE "
        "/v1/models endpoints).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="Updated at most once a minute.",
    )
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def revoked(self) -> bool:
        """Whether the key was revoked (a revoked key is refused, never deleted)."""
        return self.revoked_at is not None


class UserLimits(SingletonModel):
    """The limits of every logged-in user's chat (WebSocket chat with a
    session), across all their sockets; a user's override replaces them."""

    rpm_limit = models.PositiveIntegerField(
        "requests per minute",
        default=60,
        help_text="Chat messages per minute of one user. 0: unlimited.",
    )
    max_concurrent = models.PositiveIntegerField(
        "max concurrent engine requests",
        default=4,
        help_text="Engine requests of one user in flight at once, over all their "
        "sockets (a message with n choices counts n). 0: unlimited.",
    )

    class Meta:
        verbose_name = verbose_name_plural = "user limits"

    def __str__(self) -> str:
        return "User limits"


class UserLimitOverride(models.Model):
    """One user's own limits instead of the defaults."""

    defaults = models.ForeignKey(
        UserLimits, on_delete=models.CASCADE, related_name="overrides"
    )
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="chat_limits",
    )
    rpm_limit = models.PositiveIntegerField(
        "requests per minute", help_text="0: unlimited."
    )
    max_concurrent = models.PositiveIntegerField(
        "max concurrent engine requests", help_text="0: unlimited."
    )

    class Meta:
        verbose_name = "user's own limits"
        verbose_name_plural = "users' own limits"

    def __str__(self) -> str:
        return f"Limits of {self.user}"


class Endpoint(models.TextChoices):
    """The API endpoints a usage row can be about."""

    CHAT_COMPLETIONS = "chat.completions", "/v1/chat/completions"
    COMPLETIONS = "completions", "/v1/completions"
    EMBEDDINGS = "embeddings", "/v1/embeddings"
    WS_CHAT = "ws.chat", "WebSocket /ws/chat/"
    # The other dialects (issue 35): each a translation onto the same pipeline;
    # the endpoint says which dialect a usage row was asked in.
    RESPONSES = "responses", "OpenAI /v1/responses"
    MESSAGES = "messages", "Anthropic /v1/messages"
    MESSAGES_COUNT_TOKENS = (
        "messages.count_tokens",
        "Anthropic /v1/messages/count_tokens",
    )
    OLLAMA_CHAT = "ollama.chat", "Ollama /api/chat"
    OLLAMA_GENERATE = "ollama.generate", "Ollama /api/generate"
    OLLAMA_EMBED = "ollama.embed", "Ollama /api/embed"
    RERANK = "rerank", "/v1/rerank, /v2/rerank"
    TOKENIZE = "tokenize", "/tokenize"
    DETOKENIZE = "detokenize", "/detokenize"


class Usage(models.Model):
    """One API request or WebSocket chat stream: who asked (a key, or a logged-in
    user) which model on which engine, tokens and outcome."""

    key = models.ForeignKey(
        ApiKey,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="usage",
    )
    # A logged-in user's WebSocket chat: no key, the user instead.
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="usage",
    )
    model = models.CharField(
        max_length=128,
        blank=True,
        help_text="The model the client asked for (empty: refused before it said).",
    )
    engine = models.CharField(max_length=64, blank=True)
    node = models.CharField(
        max_length=64, blank=True, help_text="The engine's node (cluster)."
    )
    endpoint = models.CharField(max_length=32, choices=Endpoint.choices)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(
        default=0,
        help_text="Prompt tokens taken from the engine's prompt cache (included "
        "in the prompt tokens).",
    )
    latency_ms = models.FloatField(default=0)
    status = models.PositiveSmallIntegerField(help_text="HTTP status of the answer.")
    error_code = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "usage"
        verbose_name_plural = "usage"

    def __str__(self) -> str:
        return f"{self.endpoint} {self.model} {self.status}"


class StoredResponse(models.Model):
    """A Responses API answer kept (its `store`, true by default) so that its
    owner can read it again, delete it and chain the next turn onto it
    (`previous_response_id`): the key that asked it (or the logged-in user),
    the answer as sent, this turn's input items and the conversation so far
    as chat messages (the chain's inputs and outputs, without instructions)."""

    id = models.CharField(primary_key=True, max_length=64, editable=False)
    key = models.ForeignKey(
        ApiKey,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="stored_responses",
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="stored_responses",
    )
    model = models.CharField(max_length=200)
    body = models.JSONField(help_text="The Response object as it was answered.")
    input_items = models.JSONField(
        help_text="The input items, with ids: the chain's earlier turns' inputs "
        "and outputs, then this turn's."
    )
    conversation = models.JSONField(
        help_text="The chain's messages up to and with this answer (chat's shape)."
    )
    size_bytes = models.PositiveIntegerField(
        default=0, help_text="The stored JSON's size (capped)."
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "stored response"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(key__isnull=False) | models.Q(user__isnull=False),
                name="stored_response_has_owner",
            )
        ]

    def __str__(self) -> str:
        return self.id
