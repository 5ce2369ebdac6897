"""The model catalog: which models the platform serves, from where, and how."""

import os
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from engines.inspection.messages import QUANTIZATIONS
from engines.launch.config import gpu_layers_problem, tensor_split_problem
from engines.wire.bounds import check_sampling
from engines.wire.errors import ProtocolError
from routing.placement import label_problem


def validate_labels(value: object) -> None:
    """A list of node labels (routing.placement.LABEL)."""
    problem = label_problem(value)
    if problem is not None:
        raise ValidationError(problem)


MODEL_NAME_VALIDATOR = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
    "Use letters, digits and . _ : / - (the name clients send as `model`).",
)
# The sampling fields a model may set a default for (the engine's own names).
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "seed",
)


class ModelFormat(models.TextChoices):
    GGUF = "gguf", "GGUF (llama.cpp)"
    TRANSFORMERS = "transformers", "Transformers"
    # An embedder, or a cross-encoder (a model of the rerank task).
    EMBEDDING = "embedding", "Sentence-transformers (embedder or cross-encoder)"


class ModelTask(models.TextChoices):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    # A cross-encoder: scores (query, document) pairs (/v1/rerank).
    RERANK = "rerank"


# The tasks of a sentence-transformers model (ModelFormat.EMBEDDING).
SENTENCE_TRANSFORMERS_TASKS = (ModelTask.EMBEDDING, ModelTask.RERANK)

# A path component longer than this is refused by every common file system.
MAX_PATH_COMPONENT = 255
MAX_PATH_BYTES = 4096


class ModelPathError(ValueError):
    """A catalog model's path that this host cannot use; `str()` says why."""


def model_path_resolve(path: str) -> Path:
    """A catalog path as a path on this host (`~` expanded, a relative path
    under the models directory); ModelPathError for one no host can use: an
    unknown user's `~user`, a NUL byte, a component over 255 bytes or a path
    over 4096. Touches no file."""
    if not path or "\x00" in path:
        raise ModelPathError("a model path must be a non-empty path without NUL")
    try:
        expanded = Path(path).expanduser()
    except RuntimeError as error:  # ~nosuchuser
        raise ModelPathError(f"cannot expand {path!r}: {error}") from None
    resolved = (
        expanded if expanded.is_absolute() else Path(settings.MODELS_DIR) / expanded
    )
    long = [
        part for part in resolved.parts if len(os.fsencode(part)) > MAX_PATH_COMPONENT
    ]
    if long:
        raise ModelPathError(
            f"a component of the path is over {MAX_PATH_COMPONENT} bytes: "
            f"{long[0][:40]}..."
        )
    if len(os.fsencode(str(resolved))) > MAX_PATH_BYTES:
        raise ModelPathError(f"the path is over {MAX_PATH_BYTES} bytes")
    return resolved


def validate_sampling(value: object) -> None:
    """Default sampling parameters: known names, each within the bounds the
    engines check every request against (by the same function)."""
    if not isinstance(value, dict):
        raise ValidationError("Sampling parameters must map names to numbers.")
    errors = [
        f"unknown parameter {key!r} (known: {', '.join(SAMPLING_KEYS)})"
        for key in value
        if key not in SAMPLING_KEYS
    ]
    errors += [f"{key} must be a number" for key, item in value.items() if item is None]
    try:
        check_sampling({k: v for k, v in value.items() if k in SAMPLING_KEYS})
    except ProtocolError as error:
        errors.append(error.message)
    if errors:
        raise ValidationError("; ".join(errors))


class ContextOverflow(models.TextChoices):
    # The values engines know (engines.launch.config.CONTEXT_OVERFLOW).
    REFUSE = "refuse", "Refuse with the counts"
    DROP_OLDEST = "drop_oldest", "Drop the oldest turns"


class Dtype(models.TextChoices):
    # The values engines know (engines.launch.config.DTYPES).
    AUTO = "auto", "Its own (bfloat16/float16 on a GPU, float32 on the CPU)"
    FLOAT32 = "float32", "float32"
    BFLOAT16 = "bfloat16", "bfloat16"
    FLOAT16 = "float16", "float16"


def validate_gpu_layers(value: object) -> None:
    problem = gpu_layers_problem(str(value))
    if problem:
        raise ValidationError(problem)


def validate_tensor_split(value: object) -> None:
    problem = tensor_split_problem(str(value))
    if problem:
        raise ValidationError(problem)


class JobState(models.TextChoices):
    """Where a background job on a model stands (empty: never asked for)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class ModelConfig(models.Model):
    """One servable model: its file, format, task, engine pin and serving limits."""

    name = models.CharField(
        max_length=128,
        unique=True,
        validators=[MODEL_NAME_VALIDATOR],
        help_text="The name (alias) clients ask for.",
    )
    format = models.CharField(max_length=16, choices=ModelFormat.choices)
    path = models.CharField(
        max_length=1000,
        help_text="File or folder; a relative path is under the models directory.",
    )
    projector = models.CharField(
        max_length=1000,
        blank=True,
        help_text="A vision model's projector (mmproj) file, pulled beside it; "
        "a relative path is under the models directory.",
    )
    task = models.CharField(max_length=16, choices=ModelTask.choices)
    engine_pin = models.CharField(
        max_length=64,
        blank=True,
        help_text="Engine that should serve this model. Empty: chosen by routing.",
    )
    replicas = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text="Engines that keep this model loaded, spread over the nodes; "
        "requests are balanced over them. A pin still wins.",
    )
    node_labels = models.JSONField(
        "run only on nodes labelled",
        default=list,
        blank=True,
        validators=[validate_labels],
        help_text='Every label a node must have to hold a replica, e.g. ["gpu"].',
    )
    avoid_labels = models.JSONField(
        "never on nodes labelled",
        default=list,
        blank=True,
        validators=[validate_labels],
        help_text="No replica on a node with any of these labels.",
    )
    context_length = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(16)],
        help_text="Context window (n_ctx). Empty: the model's own.",
    )
    slots = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Parallel sessions of this model. Empty: auto, as many as the "
        "KV memory budget allows, up to the engine's slot cap (Concurrency "
        "settings).",
    )
    batch_window_ms = models.FloatField(
        default=5.0,
        validators=[MinValueValidator(0)],
        help_text="How long a batch waits for more requests to join (0: no wait).",
    )
    max_batch_size = models.PositiveIntegerField(
        default=64, validators=[MinValueValidator(1)]
    )
    keep_alive_s = models.PositiveIntegerField(
        default=300,
        help_text="Idle seconds before the model is unloaded (0: it stays until "
        "its memory is needed).",
    )
    sampling = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_sampling],
        help_text='Default sampling, e.g. {"temperature": 0.7, "top_p": 0.95}.',
    )
    chat_template = models.TextField(
        blank=True, help_text="Jinja chat template. Empty: the model's own."
    )
    prompt_cache = models.BooleanField(
        default=True,
        help_text="Keep each slot's KV between requests and reuse it for a prompt "
        "that starts the same way (a chat's next turn evaluates only its new "
        "tokens). Off: every prompt is evaluated in full.",
    )
    share_prompt_cache_across_owners = models.BooleanField(
        default=False,
        help_text="Let every API key and user reuse one another's cached prompt "
        "prefixes (and route to them). Faster for a system prompt many callers "
        "share, but one caller can then tell, from timing or cached_tokens, "
        "whether another sent a given prefix. Off: each key or user has its "
        "own cache scope.",
    )
    context_overflow = models.CharField(
        max_length=16,
        choices=ContextOverflow.choices,
        default=ContextOverflow.REFUSE,
        help_text="A chat longer than the context: refused with the counts "
        "(context_length_exceeded), or answered with its oldest turns left out "
        "(the system prompt and the latest message always stay).",
    )
    gpu_layers = models.CharField(
        "GPU layers",
        max_length=8,
        default="auto",
        validators=[validate_gpu_layers],
        help_text="GGUF on a GPU engine: auto (as many layers as its cards' free "
        "memory holds, the rest on the CPU), all, none, or a number of layers.",
    )
    tensor_split = models.CharField(
        max_length=100,
        blank=True,
        validators=[validate_tensor_split],
        help_text="GGUF on an engine with several cards: each card's share of the "
        "layers, in the engine's card order, e.g. 3,1. Empty: by their free memory.",
    )
    dtype = models.CharField(
        "precision",
        max_length=16,
        choices=Dtype.choices,
        default=Dtype.AUTO,
        help_text="Transformers models: the precision the weights load in.",
    )
    max_gpu_percent = models.PositiveSmallIntegerField(
        "max GPU %",
        default=90,
        validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="Transformers models: the share of each card's memory the model "
        "may take; what does not fit is offloaded to the CPU.",
    )
    enabled = models.BooleanField(default=True)
    measured_memory_mib = models.PositiveIntegerField(
        null=True, blank=True, help_text="Host memory measured after a load."
    )
    measured_device_memory_mib = models.PositiveIntegerField(
        null=True, blank=True, help_text="Device memory measured after a load."
    )
    measured_at = models.DateTimeField(null=True, blank=True)
    # What the model's files say (catalog.inspection.Inspection.as_dict),
    # filled by the Celery task catalog.inspect_model.
    inspection = models.JSONField(default=dict, blank=True, editable=False)
    inspected_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The expected SHA-256 of each of the model's files (the path its
    # manifest lists it under -> hex digest; "" for a one-file model), from
    # its first inspection or, when unknown, the first hash of its files by a
    # host with the front's database credentials. Copies between nodes are
    # checked against these, never against the serving node's word; node
    # database roles only read them.
    file_digests = models.JSONField(default=dict, blank=True, editable=False)
    # Memory measurement (the Celery task catalog.measure_model): its state,
    # what it is doing or what went wrong, and the probe's whole report
    # (engines.inspection.messages.ProbeResult). The figures engines use are measured_*.
    memory_job = models.CharField(
        max_length=8, choices=JobState.choices, blank=True, editable=False
    )
    memory_job_progress = models.CharField(max_length=500, blank=True, editable=False)
    memory_report = models.JSONField(default=dict, blank=True, editable=False)
    # A variant made by requantizing another model (the Celery task
    # catalog.requantize_model): the model it was made from, in which
    # quantization, the job's state and progress, and how the two compare on
    # this host (catalog.requantize.comparison).
    derived_from = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="variants",
        editable=False,
    )
    quantized_to = models.CharField(
        max_length=8,
        choices=[(name, name) for name in QUANTIZATIONS],
        blank=True,
        editable=False,
    )
    requantize_job = models.CharField(
        max_length=8, choices=JobState.choices, blank=True, editable=False
    )
    requantize_job_progress = models.CharField(
        max_length=500, blank=True, editable=False
    )
    comparison = models.JSONField(default=dict, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "model"
        constraints = [
            # Requantizing a model again to the same type refreshes its variant.
            models.UniqueConstraint(
                fields=["derived_from", "quantized_to"],
                condition=models.Q(derived_from__isnull=False),
                name="catalog_one_variant_per_quantization",
            )
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        try:
            model_path_resolve(self.path)
        except ModelPathError as error:
            raise ValidationError({"path": str(error)}) from None
        sentence_transformers = self.format == ModelFormat.EMBEDDING
        if sentence_transformers != (self.task in SENTENCE_TRANSFORMERS_TASKS):
            raise ValidationError(
                {
                    "task": "Sentence-transformers models have the embedding task "
                    "(an embedder) or the rerank task (a cross-encoder), and only "
                    "they do."
                }
            )

    @property
    def resolved_path(self) -> Path:
        """The model's path, relative paths taken under the models directory;
        ModelPathError for a path this host cannot use (model_path_resolve):
        a caller that handles many models skips that one alone."""
        return model_path_resolve(self.path)


class PullStatus(models.TextChoices):
    """Where a model's pull stands."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# A pull that may still move (a worker holds it or will).
PULL_OPEN = (PullStatus.QUEUED, PullStatus.RUNNING)


class ModelPull(models.Model):
    """A model's files being fetched from where models live (the Hugging Face
    Hub, an HTTPS address) onto a host, then added to the catalog: what was
    asked, what it resolved to before the download (the plan: the
    repository's commit and files), and its progress."""

    source = models.CharField(
        max_length=1000,
        help_text="hf:ORG/REPO[:QUANTIZATION | /FILE], or an https:// address.",
    )
    name = models.CharField(
        max_length=128,
        validators=[MODEL_NAME_VALIDATOR],
        help_text="The model's name in the catalog once pulled.",
    )
    revision = models.CharField(max_length=200, default="main")
    sha256 = models.CharField(
        max_length=64,
        blank=True,
        help_text="The file's expected SHA-256 (an https:// source needs it).",
    )
    node = models.CharField(
        max_length=64,
        blank=True,
        help_text="The node that pulls it. Empty: the first worker that takes it.",
    )
    node_reason = models.CharField(
        max_length=300,
        blank=True,
        editable=False,
        help_text="Why it pulls on its node when none was asked for (a "
        "cluster's default: where the model's first replica is placed).",
    )
    status = models.CharField(
        max_length=16, choices=PullStatus.choices, default=PullStatus.QUEUED
    )
    plan = models.JSONField(
        default=dict,
        blank=True,
        editable=False,
        help_text="What the source resolved to before the download: the "
        "repository at its commit, the files with their sizes and SHA-256, the "
        "model's format, task and memory need.",
    )
    size_bytes = models.BigIntegerField(default=0, editable=False)
    done_bytes = models.BigIntegerField(default=0, editable=False)
    rate_bps = models.FloatField(default=0.0, editable=False)
    left_s = models.FloatField(null=True, blank=True, editable=False)
    progress_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="When bytes last came (or its run started), by the "
        "database's clock: a pull quiet for long has stalled.",
    )
    message = models.TextField(blank=True, editable=False)
    model = models.ForeignKey(
        ModelConfig,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="pulls",
        editable=False,
    )
    cancel_requested = models.BooleanField(default=False, editable=False)
    lease_owner = models.CharField(max_length=200, blank=True, editable=False)
    lease_until = models.DateTimeField(null=True, blank=True, editable=False)
    crashes = models.PositiveSmallIntegerField(default=0, editable=False)
    queued_at = models.DateTimeField(null=True, blank=True, editable=False)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="model_pulls",
        editable=False,
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True, editable=False)
    finished_at = models.DateTimeField(null=True, blank=True, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "model pull"
        constraints = [
            # Two pulls in flight under one name would race for its row.
            models.UniqueConstraint(
                fields=["name"],
                condition=models.Q(status__in=PULL_OPEN),
                name="catalog_one_open_pull_per_name",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} from {self.source}"

    @property
    def fraction(self) -> float:
        """How much of it is downloaded, 0 to 1."""
        return self.done_bytes / self.size_bytes if self.size_bytes else 0.0
