"""The model admin's part about this host's disk (mixed into the ModelConfig
admin that fleet/admin.py registers): a column with what each model's files
take here, and the action "Delete files from this host", which first shows
what it would delete and its size (as Django's delete confirmation does) and
refuses a model loaded or placed here with the reason."""

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.template.response import TemplateResponse

from catalog.models import ModelConfig

from .disk import ModelInUse, disk_report, model_files_delete, model_files_plan

MIB = 2**20


def size_text(size_bytes: float) -> str:
    """`812 KiB`, `812 MiB`, `1.2 GiB`."""
    if size_bytes < MIB:
        return f"{size_bytes / 1024:.0f} KiB"
    if size_bytes < 1024 * MIB:
        return f"{size_bytes / MIB:.0f} MiB"
    return f"{size_bytes / 1024 / MIB:.1f} GiB"


class ModelFilesAdmin:
    """For a ModelConfig admin: `files_here` (a column) and the action
    `files_delete_here`."""

    @admin.display(description="files here")
    def files_here(self, model: ModelConfig) -> str:
        """What the model's files take on this host's disk (its last report,
        measured at most every 30 s), or "—" when they are not here."""
        mib = disk_report().get("models", {}).get(model.name)
        return "—" if mib is None else size_text(mib * MIB)

    @admin.action(description="Delete files from this host", permissions=["delete"])
    def files_delete_here(self, request, queryset):
        """The confirmation page (what would be deleted, its size); once
        confirmed, each model's files deleted. A model loaded or placed on
        this host is refused with the reason, as a message."""
        models = list(queryset)
        plans = {model.pk: model_files_plan(model=model) for model in models}
        refused = [model for model in models if plans[model.pk].in_use]
        for model in refused:
            self.message_user(
                request,
                f"Not deleted: {model.name} is {plans[model.pk].in_use}.",
                messages.ERROR,
            )
        if refused:
            return None
        if request.POST.get("post") != "yes":
            return self._files_confirmation(request, models, plans)
        for model in models:
            self._files_delete(request, model)
        return None

    def _files_confirmation(self, request, models, plans) -> TemplateResponse:
        rows = []
        for model in models:
            plan = plans[model.pk]
            rows.append(
                {
                    "model": model,
                    "removed": [(path, size_text(size)) for path, size in plan.removed],
                    "kept": plan.kept,
                    "size": size_text(plan.bytes),
                }
            )
        total = sum(plan.bytes for plan in plans.values())
        context = {
            **self.admin_site.each_context(request),
            "title": "Delete model files from this host?",
            "opts": self.model._meta,
            "rows": rows,
            "total": size_text(total),
            "nothing": not any(plan.removed for plan in plans.values()),
            "disk": disk_report(),
            "models": models,
            "action": "files_delete_here",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(
            request, "admin/catalog/modelconfig/delete_files.html", context
        )

    def _files_delete(self, request, model: ModelConfig) -> None:
        try:
            freed = model_files_delete(model=model)
        except ModelInUse as refused:
            self.message_user(request, f"Not deleted: {refused}.", messages.ERROR)
            return
        except OSError as error:
            self.message_user(
                request,
                f"Could not delete all of {model.name}'s files: {error}",
                messages.ERROR,
            )
            return
        message = f"Deleted its files from this host ({size_text(freed)} freed)."
        self.log_change(request, model, message)
        self.message_user(
            request,
            f"{model.name}: files deleted from this host, {size_text(freed)} freed. "
            "Its row stays: pull or copy its files again to serve it here.",
            messages.SUCCESS,
        )
