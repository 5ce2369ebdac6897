"""Control-plane data of the fleet: engine specs, their live state, and the
server-wide limits the supervisor pushes to running engines."""

import re

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from engines.launch.environment import arg_max, env_problems
from routing import compat

ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PORT_VALIDATORS = [MinValueValidator(1024), MaxValueValidator(65535)]


class Backend(models.TextChoices):
    CPU = "cpu", "CPU"
    CUDA = "cuda", "CUDA (NVIDIA)"
    ROCM = "rocm", "ROCm (AMD)"
    VULKAN = "vulkan", "Vulkan (llama.cpp only)"


def validate_env_block(value: object) -> None:
    """An env block maps valid variable names to strings; empty strings are kept."""
    if not isinstance(value, dict):
        raise ValidationError("The env block must map names to values.")
    bad_keys = [key for key in value if not ENV_KEY_RE.match(str(key))]
    if bad_keys:
        raise ValidationError(
            "Not valid environment variable names: %(keys)s",
            params={"keys": ", ".join(repr(key) for key in bad_keys)},
        )
    bad_values = [key for key, item in value.items() if not isinstance(item, str)]
    if bad_values:
        raise ValidationError(
            'Values must be strings (use "" for empty): %(keys)s',
            params={"keys": ", ".join(bad_values)},
        )
    # What exec would refuse, found here rather than when the engine starts. The
    # block may take half of ARG_MAX: the rest is for the supervisor's own
    # environment and the engine's configuration.
    problems = env_problems(value, budget=arg_max() // 2)
    if problems:
        raise ValidationError(
            "The engine could not be started with this env block: %(problems)s.",
            params={"problems": "; ".join(problems)},
        )


CPU_LIST_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_CPU = 4095


def parse_cpu_list(text: str) -> list[int]:
    """CPU cores in Linux's list syntax ("0-3,6"), sorted; ValueError naming the
    bad item. Empty: no restriction ([])."""
    cores: set[int] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        match = CPU_LIST_ITEM.match(item)
        if match is None:
            raise ValueError(f"'{item}' is not a core number or a range like 0-3")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if last < first or last > MAX_CPU:
            raise ValueError(
                f"'{item}' is not a range from low to high (up to {MAX_CPU})"
            )
        cores.update(range(first, last + 1))
    return sorted(cores)


def validate_cpu_list(value: str) -> None:
    try:
        parse_cpu_list(value)
    except ValueError as error:
        raise ValidationError(f"CPU cores: {error}.") from None


def validate_capabilities(value: object) -> None:
    """Capabilities are a list of known model formats."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValidationError("Capabilities must be a list of formats.")
    unknown = sorted(set(value) - set(compat.FORMATS))
    if unknown:
        raise ValidationError(
            "Unknown formats: %(formats)s", params={"formats": ", ".join(unknown)}
        )


class EngineSpec(models.Model):
    """One engine process the supervisor keeps running: its backend, devices, env."""

    name = models.SlugField(max_length=64, unique=True)
    backend = models.CharField(
        max_length=16, choices=Backend.choices, default=Backend.CPU
    )
    env = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_env_block],
        help_text="Applied over the supervisor's environment when the engine "
        "starts; an empty value is set as empty (e.g. CUDA_VISIBLE_DEVICES=).",
    )
    capabilities = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_capabilities],
        help_text="Model formats this engine serves. Empty: the backend's defaults.",
    )
    devices = models.CharField(
        max_length=500,
        blank=True,
        help_text="Devices this engine owns, comma-separated (GPU UUIDs or "
        "indices); judged for thermal pauses.",
    )
    cpus = models.CharField(
        "CPU cores",
        max_length=200,
        blank=True,
        validators=[validate_cpu_list],
        help_text="CPU cores the engine may run on, in Linux's list syntax (0-3,6); "
        "its compute threads default to one per core it may use. Empty: all. "
        "Leaving a core to the front keeps it from slowing the engine down.",
    )
    node = models.ForeignKey(
        "cluster.Node",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="engines",
        help_text="The host that runs this engine (its `manage.py supervise --node "
        "NAME`). Empty: the supervisor started without --node (one host).",
    )
    enabled = models.BooleanField(default=True)
    order = models.PositiveIntegerField(
        default=0, help_text="The first enabled engine by order is the primary."
    )
    port = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=PORT_VALIDATORS,
        help_text="Fixed loopback port. Empty: the server's base port + order.",
    )
    restart_requested_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="Set by the admin's restart action; the supervisor acts on it.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["order", "name"]
        verbose_name = "engine spec"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Refuse a loopback port another enabled engine already uses."""
        if not self.enabled:
            return
        base_port = ServerSettings.load().base_port
        field = "port" if self.port else "order"
        mine = self.port_with(base_port)
        if mine > PORT_VALIDATORS[1].limit_value:
            raise ValidationError(
                {field: f"Base port {base_port} + order {self.order} is past 65535."}
            )
        # Ports are per host: engines of other nodes listen on their own loopback.
        others = EngineSpec.objects.filter(enabled=True, node_id=self.node_id).exclude(
            pk=self.pk
        )
        for other in others:
            if other.port_with(base_port) == mine:
                raise ValidationError(
                    {
                        field: f"Port {mine} is already engine {other.name!r}'s "
                        f"({other.port_source(base_port)}): set another fixed port "
                        "or order."
                    }
                )

    def port_with(self, base_port: int) -> int:
        """The loopback port: the fixed one, else the base port + order."""
        return self.port or base_port + self.order

    def port_source(self, base_port: int) -> str:
        if self.port:
            return "its fixed port"
        return f"base port {base_port} + order {self.order}"

    @property
    def effective_capabilities(self) -> frozenset[str]:
        """Formats served: the override when set, else the backend's defaults."""
        return compat.capabilities_for(self.backend, self.capabilities)

    @property
    def cpu_list(self) -> list[int]:
        return parse_cpu_list(self.cpus)

    @property
    def device_list(self) -> list[str]:
        return [item.strip() for item in self.devices.split(",") if item.strip()]

    def as_view(self) -> compat.EngineView:
        """This spec as routing sees it."""
        return compat.EngineView(
            name=self.name,
            backend=self.backend,
            capabilities=self.effective_capabilities,
            enabled=self.enabled,
        )


class EngineStatus(models.TextChoices):
    """What the supervisor last saw; routing.select.SERVING_STATES take requests."""

    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    COOLING = "cooling"
    # Its decode loop died or is stuck (the reason is in last_error): being
    # drained and replaced.
    UNHEALTHY = "unhealthy"
    STOPPING = "stopping"  # draining before a stop or restart
    CRASHED = "crashed"
    STOPPED = "stopped"


class EngineState(models.Model):
    """What the supervisor last saw of an engine. Written only by the supervisor."""

    spec = models.OneToOneField(
        EngineSpec, on_delete=models.CASCADE, primary_key=True, related_name="state"
    )
    status = models.CharField(
        max_length=16, choices=EngineStatus.choices, default=EngineStatus.STOPPED
    )
    pid = models.PositiveIntegerField(null=True, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    resident_models = models.JSONField(
        default=list,
        blank=True,
        help_text='Resident models: [{"name": ..., "memory_mib": ...}, ...]',
    )
    slots_in_use = models.PositiveIntegerField(default=0)
    queue_depth = models.PositiveIntegerField(default=0)
    cooling_reason = models.CharField(max_length=200, blank=True)
    temperatures = models.JSONField(
        default=list,
        blank=True,
        help_text='Last temperatures: [{"device": "CPU", "celsius": 51.0}, ...]',
    )
    memory_mib = models.FloatField(
        "memory (MiB)", null=True, blank=True, help_text="The engine process's RSS."
    )
    tokens_generated = models.PositiveBigIntegerField(
        default=0, help_text="Tokens generated since the engine process started."
    )
    restart_count = models.PositiveIntegerField(default=0)
    backoff_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Crash loop: the next respawn waits until then.",
    )
    last_error = models.TextField(blank=True)

    class Meta:
        verbose_name = "engine state"

    def __str__(self) -> str:
        return f"{self.spec.name}: {self.status}"

    @property
    def in_crash_loop(self) -> bool:
        return self.status == EngineStatus.CRASHED and self.backoff_until is not None

    @property
    def resident_model_names(self) -> list[str]:
        return [item.get("name", "?") for item in self.resident_models]


class SingletonModel(models.Model):
    """A settings table with exactly one row (pk 1), created on first read."""

    singleton_pk = 1

    class Meta:
        abstract = True

    def save(self, *args, **kwargs) -> None:
        self.pk = self.singleton_pk
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValidationError(f"{self._meta.verbose_name} cannot be deleted.")

    @classmethod
    def load(cls):
        """The one row, created with defaults when missing."""
        row, _ = cls.objects.get_or_create(pk=cls.singleton_pk)
        return row


class ServerSettings(SingletonModel):
    """Server-wide defaults: routing default, residency and queue limits, ports."""

    default_engine = models.ForeignKey(
        EngineSpec,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Used when a model is compatible with several engines.",
    )
    models_max = models.PositiveIntegerField(
        default=3,
        validators=[MinValueValidator(1)],
        help_text="Most models resident at once in one engine.",
    )
    memory_margin_mib = models.PositiveIntegerField(
        default=512, help_text="Memory left free on each device and the host."
    )
    host_ram_cap_gib = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.5)],
        help_text="One host-RAM ceiling for the whole fleet. Empty: no cap.",
    )
    queue_limit = models.PositiveIntegerField(
        default=64, help_text="Requests waiting per engine before 'overloaded'."
    )
    queue_timeout_s = models.FloatField(
        default=60.0,
        validators=[MinValueValidator(0)],
        help_text="Seconds a request may wait for a slot before 'overloaded' "
        "(0: only if a slot is free now).",
    )
    base_port = models.PositiveIntegerField(
        default=8780,
        validators=PORT_VALIDATORS,
        help_text="Engine ports are base port + order unless fixed on the spec.",
    )
    stuck_after_s = models.FloatField(
        "generation stuck after (s)",
        default=60.0,
        validators=[MinValueValidator(1.0)],
        help_text="An engine whose generation loop has work and has made no step "
        "for this long reports itself unhealthy, and the supervisor replaces it.",
    )

    class Meta:
        verbose_name = verbose_name_plural = "server settings"

    def __str__(self) -> str:
        return "Server settings"

    def clean(self) -> None:
        """Refuse a base port that gives two enabled engines one port."""
        taken: dict[tuple[int | None, int], EngineSpec] = {}
        for spec in EngineSpec.objects.filter(enabled=True):
            port = spec.port_with(self.base_port)
            host = (spec.node_id, port)  # ports are per host
            if port > PORT_VALIDATORS[1].limit_value:
                raise ValidationError(
                    {"base_port": f"Engine {spec.name!r} would get port {port}."}
                )
            if host in taken:
                raise ValidationError(
                    {
                        "base_port": f"Engines {taken[host].name!r} and "
                        f"{spec.name!r} would both get port {port}."
                    }
                )
            taken[host] = spec


def check_thresholds(errors: dict, *, high: float, resume: float, field: str) -> None:
    """Record an error on `field` unless work resumes below the pause threshold."""
    if high is not None and resume is not None and resume >= high:
        errors[field] = (
            f"Resume ({resume} °C) must be below high ({high} °C), or work "
            "would pause and resume at the same temperature."
        )


TEMPERATURE_VALIDATORS = [MinValueValidator(20), MaxValueValidator(130)]


class ThermalSettings(SingletonModel):
    """Default temperatures (°C) at which engines pause and resume."""

    cpu_high = models.FloatField(default=90, validators=TEMPERATURE_VALIDATORS)
    cpu_resume = models.FloatField(default=80, validators=TEMPERATURE_VALIDATORS)
    gpu_high = models.FloatField(default=85, validators=TEMPERATURE_VALIDATORS)
    gpu_resume = models.FloatField(default=75, validators=TEMPERATURE_VALIDATORS)

    class Meta:
        verbose_name = verbose_name_plural = "thermal settings"

    def __str__(self) -> str:
        return "Thermal settings"

    def clean(self) -> None:
        errors: dict = {}
        check_thresholds(
            errors, high=self.cpu_high, resume=self.cpu_resume, field="cpu_resume"
        )
        check_thresholds(
            errors, high=self.gpu_high, resume=self.gpu_resume, field="gpu_resume"
        )
        if errors:
            raise ValidationError(errors)


class GpuVendor(models.TextChoices):
    NVIDIA = "nvidia", "NVIDIA"
    AMD = "amd", "AMD"
    INTEL = "intel", "Intel"
    APPLE = "apple", "Apple"


class ThermalOverride(models.Model):
    """GPU thresholds for one vendor, replacing the GPU defaults for its cards."""

    settings = models.ForeignKey(
        ThermalSettings, on_delete=models.CASCADE, related_name="overrides"
    )
    vendor = models.CharField(max_length=16, choices=GpuVendor.choices)
    high = models.FloatField(validators=TEMPERATURE_VALIDATORS)
    resume = models.FloatField(validators=TEMPERATURE_VALIDATORS)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["settings", "vendor"], name="thermal_override_one_per_vendor"
            )
        ]
        ordering = ["vendor"]

    def __str__(self) -> str:
        return f"{self.get_vendor_display()}: pause {self.high} °C"

    def clean(self) -> None:
        errors: dict = {}
        check_thresholds(errors, high=self.high, resume=self.resume, field="resume")
        if errors:
            raise ValidationError(errors)


class ConcurrencySettings(SingletonModel):
    """Default concurrency limits of every engine."""

    max_parallel_requests = models.PositiveIntegerField(
        default=32,
        validators=[MinValueValidator(1)],
        help_text="Requests one engine runs at once.",
    )
    max_slots_per_model = models.PositiveIntegerField(
        default=32,
        validators=[MinValueValidator(1)],
        help_text="The most parallel sessions (slots) a model with auto slots "
        "gets in one engine.",
    )
    kv_cache_mib = models.PositiveIntegerField(
        "KV cache (MiB)",
        default=1536,
        validators=[MinValueValidator(16)],
        help_text="Memory for one generation model's KV cache, a pool its slots "
        "share (a long conversation may use more than its share). Auto slots: "
        "one per 1,024 tokens it holds, up to the slot cap.",
    )

    class Meta:
        verbose_name = verbose_name_plural = "concurrency settings"

    def __str__(self) -> str:
        return "Concurrency settings"


class ConcurrencyOverride(models.Model):
    """Concurrency limits for one engine; an empty field keeps the default."""

    settings = models.ForeignKey(
        ConcurrencySettings, on_delete=models.CASCADE, related_name="overrides"
    )
    engine = models.ForeignKey(
        EngineSpec, on_delete=models.CASCADE, related_name="concurrency_overrides"
    )
    max_parallel_requests = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    max_slots_per_model = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    kv_cache_mib = models.PositiveIntegerField(
        "KV cache (MiB)", null=True, blank=True, validators=[MinValueValidator(16)]
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["settings", "engine"],
                name="concurrency_override_one_per_engine",
            )
        ]

    def __str__(self) -> str:
        return f"Limits for {self.engine}"
