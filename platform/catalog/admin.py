"""Admin for the model catalog. The fleet's admin extends it with what needs
engines (the pin input's suggestions, pin status and owner columns, pin
warnings): the catalog does not depend on the fleet."""

from django.contrib import admin, messages

from .models import ModelConfig
from .selectors import model_config_problems


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
    ]

    def save_model(self, request, obj: ModelConfig, form, change) -> None:
        super().save_model(request, obj, form, change)
        for problem in model_config_problems(model=obj):
            self.message_user(request, problem, messages.WARNING)
