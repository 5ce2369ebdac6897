"""Running the engines' one-shot inspection tools
(engines/inspection/messages.py) as child processes:
the request on stdin, the result on stdout, and a deadline past which the
child, and anything it started, is killed. The heavy work (and the ML
libraries) stay in the child; this process only waits."""

import contextlib
import logging
import os
import signal
import subprocess
import sys
from typing import TypeVar

from django.conf import settings
from pydantic import ValidationError

from engines.inspection.messages import Message, inspection_environment

log = logging.getLogger("roundhouse.catalog")

# How much of a failed tool's last words (stderr) its problem quotes.
STDERR_TAIL = 300

Result = TypeVar("Result", bound=Message)


def run_inspection(
    module: str, request: Message, result_type: type[Result], *, timeout_s: float
) -> Result:
    """Run `python -m <module>` on `request`: its result, or a result whose
    problem says what went wrong (it timed out, died, or answered nonsense)."""
    process = subprocess.Popen(
        [sys.executable, "-m", module],
        cwd=settings.BASE_DIR,
        # Only what a tool uses of this process's environment: none of the
        # web side's secrets (engines/launch/environment.py INHERITED_ENV).
        env=inspection_environment(os.environ, root=str(settings.BASE_DIR)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: killed as one
    )
    try:
        out, err = process.communicate(
            request.model_dump_json().encode(), timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it ended just now
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        log.warning("%s timed out after %g s: killed", module, timeout_s)
        return result_type(problem=f"timed out after {timeout_s:g} s")
    said = err.decode("utf-8", "replace").strip()
    if process.returncode != 0:
        log.warning("%s failed (%s):\n%s", module, process.returncode, said)
        how = (
            f"was killed by signal {-process.returncode}"
            if process.returncode < 0
            else f"exited with status {process.returncode}"
        )
        return result_type(problem=f"{module} {how}: {said[-STDERR_TAIL:]}".strip())
    try:
        return result_type.model_validate_json(out)
    except ValidationError as error:
        log.warning("%s answered %r: %s", module, out[:STDERR_TAIL], error)
        return result_type(problem=f"{module} gave an unreadable result")
