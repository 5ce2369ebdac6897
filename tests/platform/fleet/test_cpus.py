"""An engine's CPU cores: the admin's list syntax, and the configuration the
supervisor starts the engine with (applied by the engine when it starts)."""

import pytest
from django.core.exceptions import ValidationError

from fleet.models import parse_cpu_list
from fleet.selectors import engines_desired
from tests.factories import EngineSpecFactory


@pytest.mark.parametrize(
    "text, cores",
    [("", []), ("1", [1]), ("0-3,6", [0, 1, 2, 3, 6]), (" 2 , 0-1,1 ", [0, 1, 2])],
)
def test_cpu_lists_parse(text, cores):
    assert parse_cpu_list(text) == cores


@pytest.mark.django_db
@pytest.mark.parametrize(
    "text, needle",
    [
        ("a", "'a' is not a core number"),
        ("3-1", "'3-1' is not a range"),
        ("0-9999", "up to"),
    ],
)
def test_bad_cpu_lists_are_refused_by_name(text, needle):
    spec = EngineSpecFactory.build(name="pinned", cpus=text)
    with pytest.raises(ValidationError) as error:
        spec.full_clean()
    assert needle in str(error.value.message_dict["cpus"])


@pytest.mark.django_db
def test_cores_reach_the_engine_config_and_restart_it_when_changed():
    def desired():
        return next(e for e in engines_desired() if e.name == "pinned")

    spec = EngineSpecFactory(name="pinned", cpus="1")
    before = desired()
    assert before.config.cpus == [1]
    spec.cpus = ""
    spec.save()
    after = desired()
    assert after.config.cpus == []
    assert after.spawn_key != before.spawn_key  # affinity is set at start
