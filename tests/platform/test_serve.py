"""The front says at start which host names it answers (Django's
ALLOWED_HOSTS), and warns when it listens beyond loopback but answers
loopback names only: every client at the host's address would get 400
DisallowedHost."""

import os
import signal
import subprocess
import sys

from tests.conftest import ROOT
from tests.engines.conftest import free_port
from tests.waiting import wait_for


def front_start_line(tmp_path, *, host: str, allowed: str | None) -> str:
    """The line a front started with `--host host` logs of its host names."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
        "ROUNDHOUSE_RUN_DIR": str(tmp_path),
        "SECRET_KEY": "serve-tests-not-secret",
    }
    env.pop("ALLOWED_HOSTS", None)
    if allowed is not None:
        env["ALLOWED_HOSTS"] = allowed
    log = tmp_path / "front.log"
    argv = [sys.executable, "-m", "roundhouse.serve", "--host", host]
    argv += ["--port", str(free_port())]
    with open(log, "wb") as out:
        front = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def said() -> str | None:
            for line in log.read_text(errors="replace").splitlines():
                if "answers the host names" in line:
                    return line
            return None

        return wait_for(said, timeout=60, what="the front's host names line")
    finally:
        front.send_signal(signal.SIGTERM)
        try:
            front.wait(30)
        except subprocess.TimeoutExpired:
            front.kill()
            front.wait(10)


def test_a_front_on_every_address_with_loopback_names_says_what_to_set(tmp_path):
    """Started as docs/operating/cluster.md starts it (--host 0.0.0.0)
    with ALLOWED_HOSTS unset: it warns that it answers 127.0.0.1 and
    localhost only and says to set ALLOWED_HOSTS (and CSRF_TRUSTED_ORIGINS
    behind an HTTPS proxy)."""
    line = front_start_line(tmp_path, host="0.0.0.0", allowed=None)
    assert "WARNING roundhouse.serve" in line
    assert "answers the host names 127.0.0.1, localhost" in line
    assert "set ALLOWED_HOSTS" in line and "CSRF_TRUSTED_ORIGINS" in line


def test_a_front_with_its_names_set_only_states_them(tmp_path):
    """Control: with ALLOWED_HOSTS naming the host, the same start states the
    names at INFO and asks for nothing."""
    line = front_start_line(
        tmp_path, host="0.0.0.0", allowed="gpu1.example,10.0.0.5,localhost"
    )
    assert "INFO roundhouse.serve" in line
    assert "answers the host names gpu1.example, 10.0.0.5, localhost" in line
    assert "set ALLOWED_HOSTS" not in line
