"""Files uploaded for the Batch API (and the output files batches write), batch
jobs, and one row per answered line: a line's row is its answer, written once
(unique per batch and line), which is what makes every line answered exactly
once however often a worker restarts."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from api.models import ApiKey


class FilePurpose(models.TextChoices):
    BATCH = "batch"
    BATCH_OUTPUT = "batch_output"


class StoredFile(models.Model):
    """A file of the Files API; its bytes live under ROUNDHOUSE_FILES_DIR, named
    by its id."""

    id = models.CharField(primary_key=True, max_length=64)
    key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="files"
    )
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "file"

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"

    @property
    def path(self):
        return settings.ROUNDHOUSE_FILES_DIR / self.id


class BatchStatus(models.TextChoices):
    # OpenAI's statuses, in the order a batch goes through them.
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# Statuses a worker still has work in (a batch in one of them whose worker is
# gone is resumed: batches.services.batches_resume).
OPEN_STATUSES = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)


class BatchEndpoint(models.TextChoices):
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"


class Batch(models.Model):
    """A batch job: an input file of requests, answered line by line by a
    Celery worker (batches.runner) into an output and an error file."""

    id = models.CharField(primary_key=True, max_length=64)
    # SET_NULL: a deleted key's batches stay (their history, their files for
    # the admin), but one without a key never runs again (it fails at its
    # run: nothing unmetered is sent to an engine). Keys are revoked, which
    # stops their batches too, rather than deleted.
    key = models.ForeignKey(
        ApiKey,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="batches",
    )
    endpoint = models.CharField(max_length=32, choices=BatchEndpoint.choices)
    input_file = models.ForeignKey(
        StoredFile, on_delete=models.PROTECT, related_name="batches"
    )
    output_file = models.ForeignKey(
        StoredFile,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    error_file = models.ForeignKey(
        StoredFile,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(
        max_length=16, choices=BatchStatus.choices, default=BatchStatus.VALIDATING
    )
    metadata = models.JSONField(default=dict, blank=True)
    # Why the whole batch failed (an unreadable input file): OpenAI's
    # `errors.data` entries.
    errors = models.JSONField(default=list, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # The worker that runs the batch ("host:pid:started") and until when its
    # claim holds unless renewed (batches.services.batch_claim).
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    # When the batch was last sent to the broker: it is not sent again while
    # that message may still be waiting for a worker (services.batches_resume).
    queued_at = models.DateTimeField(null=True, blank=True)
    # Runs of the batch that died holding it, since one last recorded an
    # answer: a batch that kills its worker is failed after a few, not
    # resumed forever (services.MAX_CRASHES).
    crashes = models.PositiveSmallIntegerField(default=0)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return self.id


class BatchLine(models.Model):
    """One line's answer: an output line (ok) or an error line."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField(
        help_text="The line's number in the file, from 0."
    )
    custom_id = models.CharField(max_length=512, blank=True)
    ok = models.BooleanField()
    # The output or error file's line, as OpenAI shapes it.
    record = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["batch", "index"], name="batch_line_answered_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.index}"
