"""`manage.py create_api_key`: prints the key once, stores its hash."""

import hashlib
import io
import re

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from api.models import ApiKey
from tests.factories import ModelConfigFactory

pytestmark = pytest.mark.django_db


def create_api_key(*args: str) -> str:
    out = io.StringIO()
    call_command("create_api_key", *args, stdout=out)
    return out.getvalue()


def test_creates_a_key_and_prints_it_once():
    """The key is printed once with a warning; the row has its hash and settings."""
    owner = get_user_model().objects.create_user(username="ops")
    first, second = ModelConfigFactory.create_batch(2)
    models = f"{first.name}, {second.name}"
    args = ["ci", "--owner", "ops", "--models", models, "--rpm", "30"]
    output = create_api_key(*args, "--max-concurrent", "4")

    [plaintext] = [line for line in output.splitlines() if line.startswith("rh-")]
    assert output.count(plaintext) == 1
    assert "shown only this once" in output
    key = ApiKey.objects.get()
    assert key.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert (key.name, key.owner, key.rpm_limit, key.max_concurrent) == (
        "ci",
        owner,
        30,
        4,
    )
    assert set(key.allowed_models.all()) == {first, second}


def test_defaults_are_unlimited():
    """Without options: no owner, every model, no limits."""
    create_api_key("open")
    key = ApiKey.objects.get()
    assert key.owner is None and not key.allowed_models.exists()
    assert (key.rpm_limit, key.max_concurrent) == (0, 0)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["ci", "--owner", "nobody"], "No user named 'nobody'"),
        (["ci", "--models", "model-x,nosuch"], "Unknown model(s): model-x, nosuch"),
        (["ci", "--rpm", "-1"], "greater than or equal to 0"),
        (["x" * 101], "at most 100 characters"),
    ],
)
def test_bad_input_is_a_command_error(args, error):
    """An unknown owner or model, or an invalid limit or name: CommandError, no key."""
    with pytest.raises(CommandError, match=re.escape(error)):
        create_api_key(*args)
    assert not ApiKey.objects.exists()
