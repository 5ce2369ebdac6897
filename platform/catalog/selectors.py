"""Reads of catalog data: what is wrong with a model's configuration.

The catalog knows nothing of the fleet (apps depend one way: fleet → catalog):
checks against engines take the engines as an argument."""

from collections.abc import Mapping
from pathlib import Path

from routing.compat import EngineView, pin_problem

from .models import ModelConfig, ModelPathError, ModelTask


def model_pin_problem(
    *, model: ModelConfig, engines: Mapping[str, EngineView]
) -> str | None:
    """Why the model's engine pin will be ignored, as a warning; None if it won't."""
    pin = pin_problem(pin=model.engine_pin, model_format=model.format, engines=engines)
    return f"Pin of {model.name!r} will be ignored: {pin}." if pin else None


def model_config_problems(
    *, model: ModelConfig, engines: Mapping[str, EngineView] | None = None
) -> list[str]:
    """Problems that do not block saving a model but will bite when serving it:
    its path, and, given the engines (fleet.selectors.engine_views()), its pin."""
    problems = []
    pin = engines is not None and model_pin_problem(model=model, engines=engines)
    if pin:
        problems.append(pin)
    try:
        if not model.resolved_path.exists():
            problems.append(
                f"Path of {model.name!r} does not exist here: {model.resolved_path}."
            )
    except (ModelPathError, OSError) as error:
        problems.append(f"Path of {model.name!r} cannot be used: {error}.")
    return problems


def model_paths(names: set[str]) -> dict[str, Path]:
    """Each named model's path on this host (relative paths resolved); a
    model whose path no host can use (ModelPathError) is left out: it fails
    alone."""
    return model_paths_checked(names)[0]


def model_paths_checked(names: set[str]) -> tuple[dict[str, Path], dict[str, str]]:
    """Each named model's path on this host, and, apart, why the path of each
    model whose path no host can use is wrong (ModelPathError)."""
    paths, problems = {}, {}
    for model in ModelConfig.objects.filter(name__in=sorted(names)):
        try:
            paths[model.name] = model.resolved_path
        except ModelPathError as error:
            problems[model.name] = str(error)
    return paths, problems


def model_file_digests(names: set[str]) -> dict[str, dict[str, str]]:
    """The catalog's SHA-256 of each named model's files ({} when unknown)."""
    rows = ModelConfig.objects.filter(name__in=sorted(names))
    return dict(rows.values_list("name", "file_digests"))


def models_without_digests() -> dict[str, Path]:
    """The models whose files' SHA-256 the catalog does not know yet, with
    their paths on this host (bad paths left out)."""
    rows = ModelConfig.objects.filter(file_digests={})
    paths = {model.name: _path_or_none(model) for model in rows}
    return {name: path for name, path in paths.items() if path is not None}


def model_file_digests_writable() -> bool:
    """Whether this connection may record the catalog's digests (a node's own
    database role may not: it only reads them)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT has_column_privilege(current_user, %s, 'file_digests', 'UPDATE')",
            [ModelConfig._meta.db_table],
        )
        return bool(cursor.fetchone()[0])


def model_files_path(name: str) -> Path | None:
    """The path of a catalog model's files on this host, for another node to
    copy (platform/node_link/files.py); None for a name the catalog lacks."""
    return model_paths({name}).get(name)


def models_for_chat() -> list[str]:
    """Names of the enabled chat models, in order: the chat page's picker."""
    rows = ModelConfig.objects.filter(enabled=True, task=ModelTask.CHAT)
    rows = rows.order_by("name")
    return list(rows.values_list("name", flat=True))


def models_servable_by(*, capabilities: frozenset[str]) -> list[dict]:
    """Enabled models an engine with these capabilities may load, as engine
    ModelSpec dicts (paths resolved)."""
    rows = ModelConfig.objects.filter(enabled=True, format__in=sorted(capabilities))
    return [
        {
            "name": model.name,
            "format": model.format,
            "path": str(path),
            "task": model.task,
            "batch_window_ms": model.batch_window_ms,
            "max_batch_size": model.max_batch_size,
            "keep_alive_s": model.keep_alive_s,
            "context_length": model.context_length,
            "slots": model.slots,
            "measured_mib": model.measured_memory_mib,
            "measured_device_mib": model.measured_device_memory_mib,
            "sampling": model.sampling,
            "chat_template": model.chat_template,
            "prompt_cache": model.prompt_cache,
            "context_overflow": model.context_overflow,
            "gpu_layers": model.gpu_layers,
            "tensor_split": model.tensor_split,
            "dtype": model.dtype,
            "max_gpu_percent": model.max_gpu_percent,
        }
        for model in rows.order_by("name")
        if (path := _path_or_none(model)) is not None
    ]


def _path_or_none(model: ModelConfig) -> Path | None:
    try:
        return model.resolved_path
    except ModelPathError:
        return None
