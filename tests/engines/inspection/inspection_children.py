"""Running the engines' one-shot inspection tools
(engines/inspection/messages.py) as the catalog runs
them: a child process, one JSON request on stdin, one JSON result on stdout."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from tests.conftest import ROOT


@dataclass
class InspectionRun:
    returncode: int
    result: dict | None  # the JSON it wrote on stdout, if any
    stderr: str


def run_inspection(
    module: str, request: dict | str, *, timeout: float = 300
) -> InspectionRun:
    """Run `python -m <module>` with `request` (a dict, or raw text) on stdin."""
    raw = request if isinstance(request, str) else json.dumps(request)
    done = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        input=raw.encode(),
        capture_output=True,
        timeout=timeout,
    )
    out = done.stdout.decode().strip()
    return InspectionRun(
        done.returncode, json.loads(out) if out else None, done.stderr.decode()
    )
