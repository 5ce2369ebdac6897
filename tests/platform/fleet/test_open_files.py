"""The supervisor raises its own limit of open files at start
(fleet/supervisor.py open_files_raise): its relay, engine connections,
database and log files share one process, and issue 31 saw a supervisor
allowed 256 files die of 300 idle connections to its relay. Each case runs
in a child process (a limit lowered here could not be raised back)."""

import os
import subprocess
import sys

from fleet.supervisor import OPEN_FILES_WANTED
from tests.conftest import ROOT

LIMITS = """
import os, resource, sys
import django
django.setup()
from fleet import supervisor
soft, hard, call = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "raise"
supervisor.OPEN_FILES_WANTED = int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
said = supervisor.open_files_raise() if call else None
now = resource.getrlimit(resource.RLIMIT_NOFILE)
print(said, now[0], now[1])
"""


def limits_after(
    soft: int, hard: int, *, call: bool = True, wanted: int = OPEN_FILES_WANTED
) -> tuple:
    """(what open_files_raise said, soft limit, hard limit) in a process that
    started with `soft` and `hard` (`call`: whether it raised them; `wanted`:
    OPEN_FILES_WANTED there)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", LIMITS, str(soft), str(hard)]
        + ["raise" if call else "keep", str(wanted)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    said, now_soft, now_hard = done.stdout.split()
    return (None if said == "None" else int(said)), int(now_soft), int(now_hard)


def test_the_supervisor_raises_its_open_files_to_the_hard_limit():
    """256 allowed of a hard 1000: raised to 1000, and said (control: a
    process that does not call it keeps 256)."""
    assert limits_after(256, 1000) == (1000, 1000, 1000)
    assert limits_after(256, 1000, call=False) == (None, 256, 1000)


def test_the_supervisor_asks_for_open_files_wanted_at_most():
    """A hard limit over OPEN_FILES_WANTED (500 here, for a hard limit any
    process may set): raised to OPEN_FILES_WANTED, not to the hard limit; a
    soft limit already over it is left as it is (never lowered)."""
    assert limits_after(256, 1000, wanted=500) == (500, 500, 1000)
    assert limits_after(800, 1000, wanted=500) == (800, 800, 1000)
