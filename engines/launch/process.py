"""Starting an engine process: the one place that builds its environment and
command line (used by the supervisor, the tests and the benchmarks)."""

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engines.launch.config import EngineConfig
from engines.launch.environment import (
    CONFIG_ENV,
    CONFIG_FILE_ENV,
    ENGINE_DEFAULT_ENV,
    LIFELINE_FD_ENV,
    MAX_ENV_STRING,
    OFFLINE_ENV,
    TOKEN_ENV,
    env_problems,
    inherited_environment,
)

ROOT = Path(__file__).resolve().parents[2]


class SpawnError(ValueError):
    """The engine cannot be started with this environment; the message says why."""


def engine_config(config: EngineConfig | Mapping[str, Any]) -> EngineConfig:
    """The typed configuration; a dict is read as the engine reads it (unknown,
    missing or mistyped keys raise ValueError here, not in the engine)."""
    if isinstance(config, EngineConfig):
        return config
    return EngineConfig.from_dict(dict(config))


def engine_environment(
    *,
    config: EngineConfig | Mapping[str, Any],
    token: str,
    spec_env: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> dict[str, str]:
    """The engine's environment: what it uses of the parent's (the allow-list
    config.INHERITED_ENV: none of the web side's secrets), offline hub
    settings and CUDA's PCI card order (ENGINE_DEFAULT_ENV, where the parent
    sets neither), the spec's env block on top (empty values kept), then its config
    (or the path of the file holding it) and token. SpawnError when exec would
    refuse it."""
    env = inherited_environment(os.environ if base is None else base)
    for key, value in {**OFFLINE_ENV, **ENGINE_DEFAULT_ENV}.items():
        env.setdefault(key, value)
    env.update(spec_env or {})
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH", "")])
    )
    env.pop(CONFIG_ENV, None)
    env.pop(CONFIG_FILE_ENV, None)
    if config_file is None:
        env[CONFIG_ENV] = engine_config(config).to_json()
    else:
        env[CONFIG_FILE_ENV] = str(config_file)
    env[TOKEN_ENV] = token
    problems = env_problems(env)
    if problems:
        raise SpawnError(f"cannot start the engine: {'; '.join(problems)}")
    return env


def fits_environment(config: EngineConfig) -> bool:
    """Whether the configuration can travel as one environment variable: up to
    half the system's limit for one, leaving ARG_MAX room for the others."""
    size = len(CONFIG_ENV) + 2 + len(config.to_json().encode())
    return size <= MAX_ENV_STRING // 2


def write_config_file(config: EngineConfig, directory: Path) -> Path:
    """Write the configuration to `<name>.config.json` in `directory`, readable
    by this user only (mode 0600, a 0700 directory); the engine deletes it."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{config.name}.config.json"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(config.to_json())
    return path


def popen_detached_kwargs() -> dict:
    """Popen arguments for a child in its own session / process group.

    POSIX: a new session, so a Ctrl-C in the parent's terminal is not delivered
    to it directly (its parent decides). Windows: CREATE_NO_WINDOW alone (with
    DETACHED_PROCESS it is an invalid combination) plus a new process group, and
    handles stay inheritable so redirected output keeps working.
    """
    if sys.platform == "win32":
        flags = subprocess.CREATE_NO_WINDOW | subprocess.CREATE_NEW_PROCESS_GROUP
        return {"creationflags": flags, "close_fds": False}
    return {"start_new_session": True, "close_fds": True}


def spawn_engine(
    *,
    config: EngineConfig | Mapping[str, Any],
    token: str,
    log_path: Path,
    spec_env: Mapping[str, str] | None = None,
    config_dir: Path | None = None,
    lifeline_fd: int | None = None,
) -> subprocess.Popen:
    """Start `python -m engines.runtime.serve` with its output appended to log_path. The
    token travels in the environment only, never on the command line.

    A configuration too large for one environment variable goes through a 0600
    file in `config_dir` (SpawnError without one). `lifeline_fd`, the read end
    of a pipe whose write end only the caller holds, is passed to the engine,
    which stops when it reads end-of-file: when the caller dies, however it dies.
    """
    config = engine_config(config)
    config_file = None
    if not fits_environment(config):
        if config_dir is None:
            raise SpawnError(
                "the engine configuration is too large for the environment and "
                "no directory was given for its file"
            )
        config_file = write_config_file(config, config_dir)
    env = engine_environment(
        config=config, token=token, spec_env=spec_env, config_file=config_file
    )
    popen_kwargs = popen_detached_kwargs()
    if lifeline_fd is not None:
        env[LIFELINE_FD_ENV] = str(lifeline_fd)
        popen_kwargs["pass_fds"] = (lifeline_fd,)
    argv = [sys.executable, "-m", "engines.runtime.serve"]
    argv += ["--name", config.name, "--port", str(config.port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            **popen_kwargs,
        )
