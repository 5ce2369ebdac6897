"""The layout rules that keep the standard library's `platform` module reachable."""

import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import ROOT


def test_platform_folder_is_not_a_package():
    """platform/ has no __init__.py: it would shadow the stdlib module."""
    assert (ROOT / "platform").is_dir()
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_import_platform_is_the_stdlib_module_in_tests():
    """With platform/ on sys.path, `import platform` is still the stdlib one."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(platform.__file__).resolve().parent == stdlib
    assert platform.python_version()


def test_import_platform_is_the_stdlib_module_in_the_django_process():
    """Inside a process set up by manage.py, `platform` is the stdlib module."""
    code = (
        "import os, platform, sysconfig; "
        "print(os.path.dirname(platform.__file__) == sysconfig.get_paths()['stdlib'])"
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"
