"""Set-up pieces `make run` relies on: the generated secret key, the demo user."""

import stat

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from tests.conftest import run_python


def test_secret_key_generated_once_with_mode_0600(tmp_path):
    """Without SECRET_KEY, one is generated into the run dir (0600) and reused."""
    code = (
        "import os; os.environ['DJANGO_SETTINGS_MODULE'] = 'roundhouse.settings'\n"
        "from django.conf import settings; print(settings.SECRET_KEY)"
    )
    env = {"ROUNDHOUSE_RUN_DIR": str(tmp_path / "run"), "SECRET_KEY": ""}
    first, second = run_python(code, env=env), run_python(code, env=env)
    assert first.returncode == 0, first.stderr
    key_file = tmp_path / "run" / "secret_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert first.stdout.strip() == second.stdout.strip() == key_file.read_text()
    assert len(key_file.read_text()) >= 50


@pytest.mark.django_db
def test_demo_user_created_once_with_printed_password(settings, capsys):
    """The generated password is printed at creation only, and it works."""
    settings.ROUNDHOUSE_ADMIN_PASSWORD = ""
    call_command("ensure_demo_user")
    out = capsys.readouterr().out
    password = out.split("with password ")[1].split()[0]
    user = get_user_model().objects.get(username="admin")
    assert user.is_staff and user.check_password(password)

    call_command("ensure_demo_user")
    assert capsys.readouterr().out == ""


@pytest.mark.django_db
def test_demo_user_password_from_environment(settings, capsys):
    """ROUNDHOUSE_ADMIN_PASSWORD is used and never printed."""
    settings.ROUNDHOUSE_ADMIN_PASSWORD = "correct-horse-battery"
    call_command("ensure_demo_user")
    assert "correct-horse-battery" not in capsys.readouterr().out
    user = get_user_model().objects.get(username="admin")
    assert user.check_password("correct-horse-battery")
