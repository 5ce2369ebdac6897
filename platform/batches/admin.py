"""Admin for batches (their progress, and cancelling them) and the files of the
Batch API. Both are read-only: they are made through the API."""

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.db.models import QuerySet
from django.http import HttpRequest

from .models import OPEN_STATUSES, Batch, StoredFile
from .services import batch_cancel


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(Batch)
class BatchAdmin(ReadOnly):
    list_display = ["id", "key", "endpoint", "status", "progress", "created_at"]
    list_filter = ["status", "endpoint"]
    search_fields = ["id", "key__name", "input_file__id"]
    list_select_related = ["key"]
    actions = ["cancel_batches"]
    readonly_fields = ["progress"]

    @admin.display(description="progress")
    def progress(self, batch: Batch) -> str:
        """Lines answered of the total, e.g. "412 / 1,000 (41%), 3 failed"."""
        done = batch.completed + batch.failed
        if not batch.total:
            return "reading the file" if batch.status in OPEN_STATUSES else "-"
        share = 100 * done // batch.total
        failed = f", {batch.failed:,} failed" if batch.failed else ""
        return f"{done:,} / {batch.total:,} ({share}%){failed}"

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """Cancelling changes a batch: the model's change permission, which
        this read-only admin does not otherwise use."""
        opts = self.opts
        codename = get_permission_codename("change", opts)
        return request.user.has_perm(f"{opts.app_label}.{codename}")

    @admin.action(description="Cancel the selected batches", permissions=["cancel"])
    def cancel_batches(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        running = [batch for batch in queryset if batch.status in OPEN_STATUSES]
        for batch in running:
            batch_cancel(batch=batch)
        self.message_user(
            request,
            f"Asked {len(running)} batch(es) to stop; ended ones are unchanged.",
            messages.SUCCESS,
        )


@admin.register(StoredFile)
class StoredFileAdmin(ReadOnly):
    list_display = ["id", "filename", "purpose", "bytes", "key", "created_at"]
    list_filter = ["purpose"]
    search_fields = ["id", "filename"]
    list_select_related = ["key"]
