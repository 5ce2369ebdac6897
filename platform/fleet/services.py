"""Writes of fleet data, starting the fleet on demand, and an operator's
orders to a running engine (load or unload a model now)."""

import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from engines.launch.process import popen_detached_kwargs
from engines.wire.client import AsyncEngineClient, EngineClient, EngineError
from engines.wire.replies import ModelState

from .models import EngineSpec, EngineState
from .supervisor_lock import SupervisorLock

ROOT = Path(__file__).resolve().parents[2]


def engine_restart_request(*, spec: EngineSpec) -> None:
    """Ask the supervisor to restart this engine (it polls the database)."""
    spec.restart_requested_at = timezone.now()
    spec.save(update_fields=["restart_requested_at"])


# A model's load may read gigabytes from disk and measure its memory: an
# operator's load order waits this long for the engine's answer.
MODEL_LOAD_TIMEOUT_S = 600.0


async def engine_model_load(
    *, engine: str, model: str, client: AsyncEngineClient | None = None
) -> ModelState:
    """Load `model` on the running engine `engine` now (it stays until it is
    idle past its keep-alive or evicted); the engine's account of it, with
    its measured memory. EngineError when the engine cannot be reached or
    refuses (a model it does not serve, not enough memory). `client`: how to
    reach it (an engine of another node); default: this host's loopback."""
    client = client or AsyncEngineClient.for_engine(settings.RUN_DIR, engine)
    reply = await client.load(model, timeout=MODEL_LOAD_TIMEOUT_S)
    return reply.model


async def engine_model_unload(
    *, engine: str, model: str, client: AsyncEngineClient | None = None
) -> None:
    """Unload `model` from the running engine `engine` once its requests in
    flight are done; EngineError and `client` as for `engine_model_load`."""
    client = client or AsyncEngineClient.for_engine(settings.RUN_DIR, engine)
    await client.unload(model, timeout=MODEL_LOAD_TIMEOUT_S)


def engine_state_record(*, spec_id: int, **fields) -> None:
    """Store what the supervisor saw of an engine (supervisor only). A spec
    deleted meanwhile is skipped; DatabaseError when the database is unavailable
    (the supervisor keeps the state and writes it when it is back)."""
    if EngineState.objects.filter(spec_id=spec_id).update(**fields):
        return
    if not EngineSpec.objects.filter(pk=spec_id).exists():
        return
    try:
        EngineState.objects.create(spec_id=spec_id, **fields)
    except IntegrityError:
        pass  # the spec was deleted since the check above


class FleetStartError(RuntimeError):
    """The supervisor could not be started or its engines did not come up."""


def fleet_ensure(*, timeout_s: float = 180.0, run_dir: Path | None = None) -> str:
    """Make sure a supervisor runs on this host; start one in the background if not.

    First instance wins: when a supervisor already holds the lock this returns
    at once ("attached"). Otherwise it starts `manage.py supervise` in a new
    session with its own log, waits until every enabled engine answers `ping`, and
    returns "started". Scripts, Celery workers and `supervise --ensure` share it.
    """
    run_dir = Path(run_dir or settings.RUN_DIR)
    lock = SupervisorLock(run_dir)
    if lock.is_held():
        return "attached"
    log_path = run_dir / "logs" / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "supervise"],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            **popen_detached_kwargs(),
        )
    names = list(EngineSpec.objects.filter(enabled=True).values_list("name", flat=True))
    deadline = time.monotonic() + timeout_s
    waiting = set(names)
    while waiting:
        if process.poll() is not None and not lock.is_held():
            raise FleetStartError(
                f"the supervisor exited with code {process.returncode}; see {log_path}"
            )
        for name in list(waiting):
            try:
                EngineClient.for_engine(run_dir, name).ping()
                waiting.discard(name)
            except EngineError:
                pass
        if waiting and time.monotonic() > deadline:
            raise FleetStartError(
                f"engines {', '.join(sorted(waiting))} did not answer within "
                f"{timeout_s:g} s; see {log_path}"
            )
        if waiting:
            time.sleep(0.25)
    return "started"
