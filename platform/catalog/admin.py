"""Admin for the model catalog."""

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from fleet.models import EngineSpec
from fleet.selectors import engine_views, routing_snapshot
from routing.compat import pin_problem

from .models import ModelConfig
from .selectors import model_config_problems


class EngineNameInput(forms.TextInput):
    """A text input suggesting the configured engine names (a pin may name an
    engine that does not exist yet; that is warned about, not refused)."""

    def render(self, name, value, attrs=None, renderer=None):
        list_id = f"{(attrs or {}).get('id', name)}_engines"
        names = EngineSpec.objects.order_by("order", "name").values_list(
            "name", flat=True
        )
        field = super().render(
            name, value, {**(attrs or {}), "list": list_id}, renderer
        )
        options = format_html_join("", '<option value="{}">', ((n,) for n in names))
        return format_html('{}<datalist id="{}">{}</datalist>', field, list_id, options)


@admin.register(ModelConfig)
class ModelConfigAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "format",
        "task",
        "engine_pin",
        "pin_status",
        "owner",
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
                ]
            },
        ),
        ("Measured", {"fields": readonly_fields}),
    ]

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        if db_field.name == "engine_pin":
            kwargs["widget"] = EngineNameInput()
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    @admin.display(description="pin")
    def pin_status(self, model: ModelConfig) -> str:
        if not model.engine_pin:
            return "routed"
        problem = pin_problem(
            pin=model.engine_pin, model_format=model.format, engines=engine_views()
        )
        return f"⚠ {problem}" if problem else "ok"

    def changelist_view(self, request, extra_context=None):
        # One snapshot for the whole list, not one per row. Shared by requests
        # running at once, which would only see each other's equally fresh copy.
        self._owners = routing_snapshot().owners()
        return super().changelist_view(request, extra_context)

    @admin.display(description="owner engine")
    def owner(self, model: ModelConfig) -> str:
        """The engine routing assigns the model to (pin, default or balanced)."""
        return getattr(self, "_owners", {}).get(model.name, "—")

    def save_model(self, request, obj: ModelConfig, form, change) -> None:
        super().save_model(request, obj, form, change)
        for problem in model_config_problems(model=obj):
            self.message_user(request, problem, messages.WARNING)
