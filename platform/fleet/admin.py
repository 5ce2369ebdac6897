"""Admin for engines and the fleet-wide limits, and the placement of the
catalog's models on engines (the pin input, pin status and owner columns and
pin warnings; the catalog cannot show them, as it does not depend on the fleet)."""

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse

from catalog.admin import ModelConfigAdmin
from catalog.models import ModelConfig
from catalog.selectors import model_pin_problem
from routing.compat import pin_problem

from .disk_admin import ModelFilesAdmin
from .forms import EngineNameInput, EngineSpecForm
from .hub_admin import hub_urls
from .models import (
    ConcurrencyOverride,
    ConcurrencySettings,
    EngineSpec,
    EngineState,
    EngineStatus,
    ServerSettings,
    ThermalOverride,
    ThermalSettings,
)
from .selectors import engine_port, engine_views, model_residence, routing_snapshot
from .services import engine_restart_request


class EngineStateInline(admin.StackedInline):
    model = EngineState
    can_delete = False
    extra = 0
    verbose_name_plural = "live state (written by the supervisor)"

    def get_readonly_fields(self, request, obj=None):
        return [field.name for field in EngineState._meta.fields]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(EngineSpec)
class EngineSpecAdmin(admin.ModelAdmin):
    form = EngineSpecForm
    list_display = [
        "name",
        "node",
        "backend",
        "enabled",
        "order",
        "loopback_port",
        "status",
        "heartbeat",
        "resident",
        "capability_list",
    ]
    list_filter = ["node", "backend", "enabled", "state__status"]
    search_fields = ["name", "devices"]
    list_select_related = ["state", "node"]
    inlines = [EngineStateInline]
    actions = ["restart_engines"]
    fieldsets = [
        (None, {"fields": ["name", "node", "backend", "enabled", "order", "port"]}),
        (
            "Devices and environment",
            {"fields": ["devices", "cpus", "env", "capabilities"]},
        ),
    ]

    @admin.display(description="port")
    def loopback_port(self, spec: EngineSpec) -> int:
        return engine_port(spec=spec)

    @admin.display(description="status", ordering="state__status")
    def status(self, spec: EngineSpec) -> str:
        state = getattr(spec, "state", None)
        if state is None:
            return "never started"
        if state.in_crash_loop:
            return f"crash loop (next try {state.backoff_until:%H:%M:%S} UTC)"
        if state.status == EngineStatus.UNHEALTHY and state.last_error:
            return state.last_error.splitlines()[0]  # "unhealthy: <reason>"
        if state.cooling_reason:
            return f"{state.status} ({state.cooling_reason})"
        return state.status

    @admin.action(description="Restart engine", permissions=["change"])
    def restart_engines(self, request: HttpRequest, queryset) -> None:
        specs = list(queryset)
        for spec in specs:
            engine_restart_request(spec=spec)
            self.log_change(request, spec, "Restart requested.")
        names = ", ".join(spec.name for spec in specs)
        self.message_user(
            request,
            f"Restart requested for {names}; the supervisor restarts "
            "within a few seconds.",
            messages.SUCCESS,
        )

    @admin.display(description="heartbeat")
    def heartbeat(self, spec: EngineSpec):
        state = getattr(spec, "state", None)
        return state.heartbeat_at if state else None

    @admin.display(description="resident models")
    def resident(self, spec: EngineSpec) -> str:
        state = getattr(spec, "state", None)
        return ", ".join(state.resident_model_names) if state else ""

    @admin.display(description="serves")
    def capability_list(self, spec: EngineSpec) -> str:
        return ", ".join(sorted(spec.effective_capabilities))


@admin.register(EngineState)
class EngineStateAdmin(admin.ModelAdmin):
    list_display = [
        "spec",
        "status",
        "pid",
        "port",
        "heartbeat_at",
        "slots_in_use",
        "queue_depth",
        "restart_count",
        "cooling_reason",
    ]
    list_filter = ["status"]
    search_fields = ["spec__name", "last_error"]

    def get_readonly_fields(self, request, obj=None):
        return [field.name for field in EngineState._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


def _inserted_after(names: list[str], anchor: str, *inserted: str) -> list[str]:
    """names with inserted placed right after anchor."""
    at = names.index(anchor) + 1
    return [*names[:at], *inserted, *names[at:]]


admin.site.unregister(ModelConfig)


@admin.register(ModelConfig)
class PlacedModelConfigAdmin(ModelFilesAdmin, ModelConfigAdmin):
    """The catalog's model admin with placement: engine names suggested for the
    pin, pin status and owner engine columns, and a warning on save about a pin
    the fleet cannot honour (unknown, disabled or incompatible engine); and
    this host's disk (fleet/disk_admin.py): what each model's files take
    here, and deleting them from this host."""

    list_display = [
        *_inserted_after(
            ModelConfigAdmin.list_display, "engine_pin", "pin_status", "owner"
        ),
        "files_here",
    ]
    actions = [*ModelConfigAdmin.actions, "files_delete_here"]
    readonly_fields = [
        *ModelConfigAdmin.readonly_fields,
        "owner_engine",
        "placed_on",
        "resident_on",
    ]
    fieldsets = [
        (
            name,
            {"fields": [*options["fields"], "owner_engine", "placed_on", "resident_on"]}
            if name == "Placement"
            else options,
        )
        for name, options in ModelConfigAdmin.fieldsets
    ]

    def get_urls(self):
        """Its own, and Add from Hugging Face (hub_admin: the fit reads engines)."""
        return [*hub_urls(self), *super().get_urls()]

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

    @admin.display(description="owner engine")
    def owner_engine(self, model: ModelConfig) -> str:
        """The change form's owner: read for this one model."""
        if model.pk is None:
            return "—"
        return routing_snapshot().owners().get(model.name, "—")

    @admin.display(description="replicas placed on")
    def placed_on(self, model: ModelConfig) -> str:
        """The engines its replicas are placed on (routing.placement), with
        their nodes."""
        if model.pk is None:
            return "—"
        snapshot = routing_snapshot()
        placed = snapshot.placed(model.name)
        if not placed:
            return "no eligible engine (format, labels, nodes)"
        return ", ".join(
            f"{name} (node {snapshot.engines[name].node})"
            if snapshot.engines[name].node
            else name
            for name in placed
        )

    @admin.display(description="resident on")
    def resident_on(self, model: ModelConfig) -> str:
        """The engines holding the model now, with its measured memory there."""
        held = model_residence(name=model.name) if model.pk else []
        if not held:
            return "no engine holds it now"
        return "; ".join(_residence_text(where) for where in held)

    def save_model(self, request, obj: ModelConfig, form, change) -> None:
        super().save_model(request, obj, form, change)  # warns of path problems
        problem = model_pin_problem(model=obj, engines=engine_views())
        if problem:
            self.message_user(request, problem, messages.WARNING)


def _residence_text(where) -> str:
    """`cpu0 (312 MiB): 8 slots (auto) sharing a 16,384-token KV pool (360 MiB)
    in 2 groups, up to 2,048 tokens per conversation`, then a GGUF model's
    offload plan on a GPU engine (`; 18 of 31 layers on 1 card (gpu-0 6.1
    GiB), 13 on the CPU`), and what was measured there (`; measured: 5.9 GiB
    on GPU-8f2c..., 41.3 tokens/s`)."""
    text = f"{where.engine} ({where.memory_mib:.0f} MiB)"
    if where.slots:
        text += f": {where.slots} slot{'s' if where.slots > 1 else ''}"
        text += " (auto)" if where.slots_auto else ""
        if where.kv_pool_tokens and where.kv_streams:
            text += (
                f", a KV stream of {where.context:,} tokens each "
                f"({where.kv_mib or 0:.0f} MiB in all)"
            )
        elif where.kv_pool_tokens:
            text += (
                f" sharing a {where.kv_pool_tokens:,}-token KV pool "
                f"({where.kv_mib or 0:.0f} MiB)"
            )
            if where.kv_groups > 1:
                text += f" in {where.kv_groups} groups"
            text += f", up to {where.context:,} tokens per conversation"
    if where.offload:
        text += f"; {where.offload}"
    measured = [
        f"{mib / 1024:.1f} GiB on {card}"
        for card, mib in (where.device_cards_mib or {}).items()
    ]
    if where.tokens_per_s:
        measured.append(f"{where.tokens_per_s:,.1f} tokens/s")
    if measured:
        text += "; measured: " + ", ".join(measured)
    return text


class SingletonAdmin(admin.ModelAdmin):
    """Admin for a one-row settings table: the list opens the row itself."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context=None):
        row = self.model.load()
        opts = self.model._meta
        return HttpResponseRedirect(
            reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[row.pk])
        )


@admin.register(ServerSettings)
class ServerSettingsAdmin(SingletonAdmin):
    fieldsets = [
        ("Routing", {"fields": ["default_engine"]}),
        (
            "Residency and memory",
            {"fields": ["models_max", "memory_margin_mib", "host_ram_cap_gib"]},
        ),
        ("Queue", {"fields": ["queue_limit", "queue_timeout_s"]}),
        ("Health", {"fields": ["stuck_after_s"]}),
        ("Ports", {"fields": ["base_port"]}),
    ]

    def save_model(self, request, obj: ServerSettings, form, change) -> None:
        super().save_model(request, obj, form, change)
        if obj.default_engine and not obj.default_engine.enabled:
            self.message_user(
                request,
                f"Default engine {obj.default_engine.name!r} is disabled: routing "
                "skips it until it is enabled.",
                messages.WARNING,
            )


class ThermalOverrideInline(admin.TabularInline):
    model = ThermalOverride
    extra = 0
    verbose_name_plural = "per-vendor GPU thresholds"


@admin.register(ThermalSettings)
class ThermalSettingsAdmin(SingletonAdmin):
    inlines = [ThermalOverrideInline]
    fieldsets = [
        ("CPU (pauses every engine)", {"fields": ["cpu_high", "cpu_resume"]}),
        (
            "GPU defaults (pause only the engine owning the card)",
            {"fields": ["gpu_high", "gpu_resume"]},
        ),
    ]


class ConcurrencyOverrideInline(admin.TabularInline):
    model = ConcurrencyOverride
    extra = 0
    verbose_name_plural = "per-engine overrides (empty: the default)"


@admin.register(ConcurrencySettings)
class ConcurrencySettingsAdmin(SingletonAdmin):
    inlines = [ConcurrencyOverrideInline]
    fields = ["max_parallel_requests", "max_slots_per_model", "kv_cache_mib"]
