"""Admin for the model catalog. The fleet's admin extends it with what needs
engines (the pin input's suggestions, pin status and owner columns, pin
warnings): the catalog does not depend on the fleet."""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.views.decorators.http import require_POST

from engines.inspection.messages import QUANTIZATIONS

from .inspection import template_facts
from .models import PULL_OPEN, ModelConfig, ModelPull
from .pull_jobs import pull_cancel
from .pull_progress import (
    left_text,
    percent_text,
    plan_text,
    progress_text,
    pull_progress,
    pulls_with_db_now,
    rate_now,
    rate_text,
)
from .selectors import model_config_problems
from .services import (
    model_inspection_queue,
    model_memory_measure_queue,
    model_requantize_queue,
    model_variant_files_remove,
)

# Files that decide what an inspection finds: a change queues a new one.
INSPECTED_FIELDS = ("format", "path")
# Read-only rows of the change form: the memory measurement's, and a
# requantized variant's.
MEMORY_JOB_FIELDS = ("memory_job_status", "memory_report_summary")
VARIANT_FIELDS = ("variant_of", "requantize_job_status", "comparison_table")


class RequantizeForm(forms.Form):
    quantization = forms.ChoiceField(
        choices=[(name, name) for name in QUANTIZATIONS],
        initial="Q4_0",
        help_text="Q4_0 is the fastest on a CPU (llama.cpp repacks it for its "
        "fast matrix kernels); Q8_0 stays closest to the original and is the "
        "largest; the K types keep more quality per bit.",
    )


# The comparison's rows: label, key, how a figure is shown, and whether the
# variant/original ratio means something.
COMPARISON_ROWS = (
    ("quantization", "quantization", "{}", False),
    ("file size, MiB", "file_mib", "{:,.1f}", True),
    ("prompt tokens/s", "prompt_tps", "{:,.1f}", True),
    ("generation tokens/s", "generation_tps", "{:,.1f}", True),
    ("perplexity (lower is better)", "perplexity", "{:.3f}", True),
    ("greedy agreement, next token", "agreement", "{:.1%}", False),
    ("greedy agreement, whole continuation", "identical_prefix", "{:.1%}", False),
)

# Rows where the original is the reference, not a figure.
AGREEMENTS = ("agreement", "identical_prefix")


@admin.register(ModelConfig)
class ModelConfigAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "format",
        "task",
        "engine_pin",
        "replicas",
        "enabled",
        "measured_memory_mib",
        "measured_device_memory_mib",
        "jobs",
    ]
    list_filter = ["format", "task", "enabled", "engine_pin"]
    search_fields = ["name", "path"]
    readonly_fields = [
        "measured_memory_mib",
        "measured_device_memory_mib",
        "measured_at",
    ]
    actions = ["inspect_again", "measure_memory", "requantize"]
    fieldsets = [
        (None, {"fields": ["name", "format", "task", "path", "enabled"]}),
        (
            "Placement",
            {"fields": ["engine_pin", "replicas", "node_labels", "avoid_labels"]},
        ),
        (
            "Serving",
            {
                "fields": [
                    "context_length",
                    "slots",
                    "batch_window_ms",
                    "max_batch_size",
                    "keep_alive_s",
                    "sampling",
                    "chat_template",
                    "prompt_cache",
                    "share_prompt_cache_across_owners",
                    "context_overflow",
                ]
            },
        ),
        (
            "GPUs",
            {"fields": ["gpu_layers", "tensor_split", "dtype", "max_gpu_percent"]},
        ),
        ("Measured", {"fields": [*readonly_fields, *MEMORY_JOB_FIELDS]}),
        ("Files", {"fields": ["inspection_summary", "inspected_at"]}),
        ("Requantized", {"fields": [*VARIANT_FIELDS, "variants_compared"]}),
    ]

    def get_readonly_fields(self, request, obj=None):
        return [
            *self.readonly_fields,
            "inspection_summary",
            "inspected_at",
            *MEMORY_JOB_FIELDS,
            *VARIANT_FIELDS,
            "variants_compared",
        ]

    def delete_model(self, request, obj: ModelConfig) -> None:
        """A requantized variant goes with the file its job wrote."""
        super().delete_model(request, obj)
        model_variant_files_remove(models=[obj])

    def delete_queryset(self, request, queryset) -> None:
        models = list(queryset)
        super().delete_queryset(request, queryset)
        model_variant_files_remove(models=models)

    def get_fieldsets(self, request, obj=None):
        """Variant rows only on a variant's page, its variants only on an
        original's."""
        hidden = set()
        if obj is None or obj.derived_from_id is None:
            hidden.update(VARIANT_FIELDS)
        if obj is None or not obj.variants.exists():
            hidden.add("variants_compared")
        fieldsets = []
        for name, options in super().get_fieldsets(request, obj):
            shown = [field for field in options["fields"] if field not in hidden]
            if shown:
                fieldsets.append((name, {**options, "fields": shown}))
        return fieldsets

    @admin.display(description="jobs")
    def jobs(self, model: ModelConfig) -> str:
        """The model's background jobs that ran or are running."""
        parts = [
            f"{name}: {_job_text(state, progress)}"
            for name, state, progress in (
                ("memory", model.memory_job, model.memory_job_progress),
                ("requantize", model.requantize_job, model.requantize_job_progress),
            )
            if state
        ]
        return "; ".join(parts) or "—"

    @admin.display(description="memory measurement")
    def memory_job_status(self, model: ModelConfig) -> str:
        if not model.memory_job:
            return "not measured (action: Measure memory of the selected models)"
        return _job_text(model.memory_job, model.memory_job_progress)

    @admin.display(description="last measurement")
    def memory_report_summary(self, model: ModelConfig) -> str:
        """What the last measurement found; the figures above are what the
        engines use (a new one replaces them when it moved more than 10%)."""
        report = model.memory_report or {}
        if not report:
            return "—"
        if report.get("problem"):
            return f"problem: {report['problem']}"
        text = f"{report['host_mib']:,.0f} MiB of host memory"
        if report.get("device_mib") is not None:
            text += f", {report['device_mib']:,.0f} MiB of device memory"
        if report.get("estimated_mib") is not None:
            text += f" (estimated {report['estimated_mib']:,.0f} MiB)"
        if report.get("slots"):
            text += (
                f", with {report['slots']} slot(s) sharing a "
                f"{report['kv_pool_tokens']:,}-token KV pool "
                f"({report['kv_mib']:,.0f} MiB), up to {report['context']:,} "
                "tokens per conversation"
            )
        return f"{text}; loaded in {report['load_s']:.1f} s, at {report['at']}"

    @admin.display(description="derived from")
    def variant_of(self, model: ModelConfig) -> str:
        original = model.derived_from
        if original is None:
            return "—"
        url = reverse("admin:catalog_modelconfig_change", args=[original.pk])
        return format_html(
            '<a href="{}">{}</a>, requantized to {}',
            url,
            original.name,
            model.quantized_to,
        )

    @admin.display(description="requantization")
    def requantize_job_status(self, model: ModelConfig) -> str:
        return _job_text(model.requantize_job, model.requantize_job_progress)

    @admin.display(description="compared with its original")
    def comparison_table(self, model: ModelConfig) -> str:
        original = model.derived_from
        name = original.name if original else "original"
        return _comparison_html(model.comparison, name, model.name)

    @admin.display(description="its variants")
    def variants_compared(self, model: ModelConfig) -> str:
        """Each variant made from this model: its job, and the two compared."""
        if model.pk is None:
            return "—"
        return format_html_join(
            "",
            '<p><a href="{}">{}</a> ({}): {}</p>{}',
            (
                (
                    reverse("admin:catalog_modelconfig_change", args=[variant.pk]),
                    variant.name,
                    variant.quantized_to,
                    _job_text(variant.requantize_job, variant.requantize_job_progress),
                    _comparison_html(variant.comparison, model.name, variant.name),
                )
                for variant in model.variants.order_by("name")
            ),
        )

    def has_requantize_permission(self, request) -> bool:
        """Requantizing adds a variant (or refreshes one): both permissions."""
        return self.has_add_permission(request) and self.has_change_permission(request)

    # Each action writes the models it is given (a job's state and what it
    # finds): it needs the permission to change them; Django's admin neither
    # offers nor runs an action to a user without it.
    @admin.action(
        description="Measure memory of the selected models",
        permissions=["change"],
    )
    def measure_memory(self, request, queryset) -> None:
        for model in queryset:
            model_memory_measure_queue(model=model)
        self.message_user(
            request,
            f"{queryset.count()} memory measurement(s) queued: each model is loaded "
            "in a child process with its context and slots",
            messages.SUCCESS,
        )

    @admin.action(
        description="Requantize the selected GGUF models…",
        permissions=["requantize"],
    )
    def requantize(self, request, queryset):
        """An intermediate page to choose the quantization, then a variant of
        each GGUF model queued."""
        form = RequantizeForm(request.POST if "apply" in request.POST else None)
        if not form.is_valid():
            context = {
                **self.admin_site.each_context(request),
                "title": "Requantize GGUF models",
                "opts": self.model._meta,
                "models": queryset,
                "form": form,
                "action": "requantize",
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(
                request, "admin/catalog/modelconfig/requantize.html", context
            )
        quantization = form.cleaned_data["quantization"]
        queued = []
        for model in queryset:
            try:
                variant = model_requantize_queue(model=model, quantization=quantization)
            except ValueError as error:
                self.message_user(request, f"Skipped: {error}.", messages.WARNING)
                continue
            except ValidationError as error:
                self.message_user(
                    request,
                    f"Skipped {model.name}: {' '.join(error.messages)}",
                    messages.ERROR,
                )
                continue
            queued.append(variant.name)
        if queued:
            self.message_user(
                request,
                f"Requantizing to {quantization}: {', '.join(queued)} (progress and "
                "the comparison on each variant's page)",
                messages.SUCCESS,
            )
        return None

    @admin.display(description="What its files say")
    def inspection_summary(self, model: ModelConfig) -> str:
        found = model.inspection or {}
        if not found:
            return "not inspected yet (queued when the model is saved)"
        if found.get("problem"):
            return f"problem: {found['problem']}"
        parts = [found.get("architecture") or "unknown architecture"]
        if found.get("parameters"):
            parts.append(f"{found['parameters'] / 1e6:,.1f}M parameters")
        if found.get("quantization"):
            parts.append(found["quantization"])
        if found.get("context_length"):
            parts.append(f"trained context {found['context_length']:,}")
        has_template, tools = found.get("chat_template"), found.get("tool_calls")
        where = ""
        if model.chat_template:  # the one set here replaces the files' own
            (has_template, tools), where = (
                template_facts(model.chat_template),
                " set here",
            )
        if has_template:
            parts.append(
                f"chat template{where} "
                + (
                    "rendering tools"
                    if tools
                    else "without tools (Roundhouse describes them)"
                )
            )
        else:
            parts.append("no chat template")
        return ", ".join(parts)

    @admin.action(
        description="Inspect the selected models' files again",
        permissions=["change"],
    )
    def inspect_again(self, request, queryset) -> None:
        for model in queryset:
            model_inspection_queue(model=model)
        self.message_user(
            request, f"{queryset.count()} inspection(s) queued", messages.SUCCESS
        )

    def save_model(self, request, obj: ModelConfig, form, change) -> None:
        super().save_model(request, obj, form, change)
        if not change or any(f in form.changed_data for f in INSPECTED_FIELDS):
            model_inspection_queue(model=obj)
        for problem in model_config_problems(model=obj):
            self.message_user(request, problem, messages.WARNING)


def _job_text(state: str, progress: str) -> str:
    return f"{state} ({progress})" if progress else state or "—"


def _shown(pattern: str, value) -> str:
    return "—" if value is None else pattern.format(value)


def _comparison_html(comparison: dict, original_name: str, variant_name: str) -> str:
    """The original and the variant side by side, as measured on one host."""
    if not comparison:
        return "—"
    original, variant = comparison["original"], comparison["variant"]
    rows = []
    for label, key, shown, ratio in COMPARISON_ROWS:
        first, second = original.get(key), variant.get(key)
        times = f"{second / first:.2f}x" if ratio and first and second else ""
        rows.append(
            (
                label,
                # The variant's agreement is with the original's choices.
                "reference" if key in AGREEMENTS else _shown(shown, first),
                _shown(shown, second),
                times,
            )
        )
    body = format_html_join(
        "", "<tr><th>{}</th><td>{}</td><td>{}</td><td>{}</td></tr>", rows
    )
    return format_html(
        '<table class="comparison"><thead><tr><th></th><th>{}</th><th>{}</th>'
        "<th>variant / original</th></tr></thead><tbody>{}</tbody></table>"
        "<p>Measured on {} with {} thread(s) at {}: perplexity over {} tokens of "
        "{}; prompt speed over {} tokens; agreement over the original's greedy "
        "continuations of {} prompts, up to {} tokens each.</p>",
        original_name,
        variant_name,
        body,
        comparison.get("host", "?"),
        comparison.get("threads", "?"),
        comparison.get("measured_at", "?"),
        comparison.get("perplexity_tokens", "?"),
        comparison.get("text", "?"),
        comparison.get("prompt_tokens", "?"),
        comparison.get("prompts", "?"),
        comparison.get("max_tokens", "?"),
    )


@admin.register(ModelPull)
class ModelPullAdmin(admin.ModelAdmin):
    """Pulls from the Hub: their progress (live on the change page: its
    script polls `progress_view` every second), cancel for those who may
    change them, and the model once done. Pulls start from Models -> Add from
    Hugging Face or `manage.py pull`, not from an add form."""

    list_display = [
        "name",
        "source",
        "node",
        "status",
        "progress_percent",
        "rate",
        "time_left",
        "created_at",
    ]
    list_filter = ["status", "node"]
    search_fields = ["name", "source"]
    actions = ["cancel_pulls"]
    change_form_template = "admin/catalog/modelpull/change_form.html"
    fields = [
        "name",
        "source",
        "revision",
        "node",
        "node_reason",
        "status_live",
        "progress",
        "model_link",
        "plan_summary",
        "requested_by",
        "created_at",
        "started_at",
        "finished_at",
    ]
    readonly_fields = fields

    class Media:
        js = ["catalog/pull_progress.js"]

    def has_add_permission(self, request) -> bool:
        return False

    def get_queryset(self, request):
        """With the database's clock, which a stall is judged by."""
        return pulls_with_db_now(super().get_queryset(request))

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path(
                "<path:object_id>/progress/",
                view(self.progress_view),
                name="catalog_modelpull_progress",
            ),
            path(
                "<path:object_id>/cancel/",
                view(require_POST(self.cancel_view)),
                name="catalog_modelpull_cancel",
            ),
            *super().get_urls(),
        ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """Read-only: no save buttons; a cancel button while the pull is open
        (change permission)."""
        pull = self.get_object(request, object_id)
        extra = {
            "title": "Model pull",
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
            "can_cancel": pull is not None
            and pull.status in PULL_OPEN
            and self.has_change_permission(request, pull),
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra)

    def progress_view(self, request: HttpRequest, object_id: str) -> JsonResponse:
        """The pull's progress as JSON, for its page's script."""
        pull = get_object_or_404(
            pulls_with_db_now(ModelPull.objects.select_related("model")), pk=object_id
        )
        if not self.has_view_permission(request, pull):
            raise PermissionDenied
        return JsonResponse({**pull_progress(pull), "model_url": _model_url(pull)})

    def cancel_view(self, request: HttpRequest, object_id: str):
        """Cancel the pull (change permission), back to its page."""
        pull = get_object_or_404(ModelPull, pk=object_id)
        if not self.has_change_permission(request, pull):
            raise PermissionDenied
        self._cancel(request, [pull])
        return HttpResponseRedirect(
            reverse("admin:catalog_modelpull_change", args=[pull.pk])
        )

    @admin.action(description="Cancel the selected pulls", permissions=["change"])
    def cancel_pulls(self, request, queryset) -> None:
        self._cancel(request, list(queryset))

    def _cancel(self, request, pulls: list[ModelPull]) -> None:
        """pull_cancel each open pull; say which were asked to stop."""
        open_pulls = [pull for pull in pulls if pull.status in PULL_OPEN]
        for pull in open_pulls:
            pull_cancel(pull=pull)
            self.log_change(request, pull, "Cancel requested.")
        if not open_pulls:
            self.message_user(
                request, "No open pull to cancel: they had ended.", messages.WARNING
            )
            return
        self.message_user(
            request,
            f"Cancelled {', '.join(pull.name for pull in open_pulls)}: a running "
            "pull stops at its next progress write and its partial files are "
            "removed.",
            messages.SUCCESS,
        )

    @admin.display(description="progress", ordering="done_bytes")
    def progress_percent(self, pull: ModelPull) -> str:
        return percent_text(pull)

    @admin.display(description="rate")
    def rate(self, pull: ModelPull) -> str:
        return rate_text(rate_now(pull)[0]) if pull.status in PULL_OPEN else "—"

    @admin.display(description="time left")
    def time_left(self, pull: ModelPull) -> str:
        return left_text(rate_now(pull)[1]) if pull.status in PULL_OPEN else "—"

    @admin.display(description="status")
    def status_live(self, pull: ModelPull) -> str:
        """Its status and last message (the script keeps them current)."""
        return format_html(
            '<span id="pull-status">{}</span> <span id="pull-message">{}</span>',
            pull.status,
            pull.message,
        )

    @admin.display(description="downloaded")
    def progress(self, pull: ModelPull) -> str:
        """A bar and its figures; the script polls the progress URL."""
        return format_html(
            '<div id="pull-progress" data-url="{}">'
            '<progress id="pull-bar" max="{}" value="{}"></progress> '
            '<span id="pull-text">{}</span></div>',
            reverse("admin:catalog_modelpull_progress", args=[pull.pk]),
            max(pull.size_bytes, 1),
            pull.done_bytes,
            progress_text(pull),
        )

    @admin.display(description="model")
    def model_link(self, pull: ModelPull) -> str:
        url = _model_url(pull)
        if not url:
            return format_html('<span id="pull-model">{}</span>', "not yet: once done")
        return format_html(
            '<span id="pull-model"><a href="{}">{}</a></span>', url, pull.model.name
        )

    @admin.display(description="what it resolved to")
    def plan_summary(self, pull: ModelPull) -> str:
        return plan_text(pull.plan)


def _model_url(pull: ModelPull) -> str:
    """The pulled model's admin page ("" before it is done)."""
    if pull.model_id is None:
        return ""
    return reverse("admin:catalog_modelconfig_change", args=[pull.model_id])
