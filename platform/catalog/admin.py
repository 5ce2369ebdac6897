"""Admin for the model catalog. The fleet's admin extends it with what needs
engines (the pin input's suggestions, pin status and owner columns, pin
warnings): the catalog does not depend on the fleet."""

from django.contrib import admin, messages

from .models import ModelConfig
from .selectors import model_config_problems
from .services import model_inspection_queue

# Files that decide what an inspection finds: a change queues a new one.
INSPECTED_FIELDS = ("format", "path")


@admin.register(ModelConfig)
class ModelConfigAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "format",
        "task",
        "engine_pin",
        "enabled",
        "measured_memory_mib",
        "measured_device_memory_mib",
    ]
    list_filter = ["format", "task", "enabled", "engine_pin"]
    search_fields = ["name", "path"]
    readonly_fields = [
        "measured_memory_mib",
        "measured_device_memory_mib",
        "measured_at",
    ]
    actions = ["inspect_again"]
    fieldsets = [
        (None, {"fields": ["name", "format", "task", "path", "enabled"]}),
        ("Placement", {"fields": ["engine_pin"]}),
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
                    "context_overflow",
                ]
            },
        ),
        ("Measured", {"fields": readonly_fields}),
        ("Files", {"fields": ["inspection_summary", "inspected_at"]}),
    ]

    def get_readonly_fields(self, request, obj=None):
        return [*self.readonly_fields, "inspection_summary", "inspected_at"]

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
        parts.append(
            "chat template" + (" with tools" if found.get("tool_calls") else "")
            if found.get("chat_template")
            else "no chat template"
        )
        return ", ".join(parts)

    @admin.action(description="Inspect the selected models' files again")
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
