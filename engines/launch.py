"""Starting an engine process: the one place that builds its environment and
command line (used by the supervisor, the tests and the benchmarks)."""

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from .config import CONFIG_ENV, OFFLINE_ENV, TOKEN_ENV

ROOT = Path(__file__).resolve().parents[1]

# Never handed to an engine: it needs none of the web side's secrets.
SCRUBBED_ENV = ("SECRET_KEY", "DATABASE_URL", "ROUNDHOUSE_ADMIN_PASSWORD")


def engine_environment(
    *,
    config: Mapping,
    token: str,
    spec_env: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The engine's environment: the parent's (secrets removed), offline hub
    settings, the spec's env block on top (empty values kept), then its config
    and token."""
    env = {
        key: value
        for key, value in (os.environ if base is None else base).items()
        if key not in SCRUBBED_ENV
    }
    for key, value in OFFLINE_ENV.items():
        env.setdefault(key, value)
    env.update(spec_env or {})
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH", "")])
    )
    env[CONFIG_ENV] = json.dumps(config, sort_keys=True)
    env[TOKEN_ENV] = token
    return env


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
    config: Mapping,
    token: str,
    log_path: Path,
    spec_env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start `python -m engines.serve` with its output appended to log_path. The
    token travels in the environment only, never on the command line."""
    argv = [sys.executable, "-m", "engines.serve"]
    argv += ["--name", str(config["name"]), "--port", str(config["port"])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=engine_environment(config=config, token=token, spec_env=spec_env),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            **popen_detached_kwargs(),
        )
