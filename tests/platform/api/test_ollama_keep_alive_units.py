"""Ollama's `keep_alive` read as seconds (api.dialects.ollama.durations)
and taken by the bodies that carry it (no engine: the reading alone; the
residency it sets: test_ollama_keep_alive.py)."""

import pytest

from api import errors
from api.dialects.ollama import protocol
from api.dialects.ollama.durations import NO_LIMIT, keep_alive_seconds
from api.schemas import parse_object


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("300ms", 0.3),
        ("10s", 10.0),
        ("0", 0.0),
        ("0s", 0.0),
        ("+2m", 120.0),
        (0, 0.0),
        (90, 90.0),
        (2.5, 2.5),
        ("-1m", NO_LIMIT),
        ("-1", NO_LIMIT),
        ("300", 300.0),
        (-1, NO_LIMIT),
        (-0.5, NO_LIMIT),
        ("9000h", NO_LIMIT),  # over a year: no limit
    ],
)
def test_durations_as_ollama_reads_them(value, seconds):
    """Numbers are seconds, strings Go durations; below 0 (or a year and
    more) no limit."""
    assert keep_alive_seconds(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "5 m", "m", "5mm", "1d", "-", "five"])
def test_what_go_would_not_read_is_refused(value):
    """Anything Go's ParseDuration refuses (a plain number aside, taken as
    seconds) is refused, naming the value."""
    with pytest.raises(Exception) as error:
        keep_alive_seconds(value)
    assert repr(value) in str(error.value)


def test_a_body_carries_seconds_and_a_bad_one_is_a_400_naming_the_field():
    """The bodies read keep_alive as seconds; a bad duration is Ollama's 400
    naming `keep_alive` (the control: the same body with a good one)."""
    chat = {"model": "m", "messages": [], "keep_alive": "2m"}
    assert parse_object(protocol.ChatBody, chat).keep_alive == 120.0
    embed = {"model": "m", "input": "x", "keep_alive": -1}
    assert parse_object(protocol.EmbedBody, embed).keep_alive == NO_LIMIT
    with pytest.raises(errors.ApiError) as refused:
        parse_object(protocol.GenerateBody, {"model": "m", "keep_alive": "soon"})
    assert refused.value.status == 400
    assert "keep_alive" in refused.value.message
