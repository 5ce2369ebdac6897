"""Sampling bounds at the engine: every value either lies within what llama.cpp
and torch take, or the request is a `bad_request` naming the field. The admin's
sampling defaults are checked by the same function."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.generation.sampling import SamplingParams
from engines.generation.templates import validate_messages
from engines.wire.bounds import (
    MAX_MESSAGES,
    MAX_PENALTY,
    MAX_REPEAT_PENALTY,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOKENS_CAP,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_REPEAT_PENALTY,
    MIN_TEMPERATURE,
    SAMPLING_FIELDS,
)
from engines.wire.errors import ProtocolError

FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
)

# (field, a value at the bound: accepted, the value just past it: refused)
EDGES = [
    ("temperature", 0, -1e-9),
    ("temperature", MIN_TEMPERATURE, MIN_TEMPERATURE / 2),
    ("temperature", MAX_TEMPERATURE, math.nextafter(MAX_TEMPERATURE, 3)),
    ("top_p", 0, -1e-9),
    ("top_p", 1, math.nextafter(1, 2)),
    ("min_p", 0, -1e-9),
    ("min_p", 1, 1.0001),
    ("repeat_penalty", MIN_REPEAT_PENALTY, MIN_REPEAT_PENALTY / 2),
    ("repeat_penalty", MAX_REPEAT_PENALTY, MAX_REPEAT_PENALTY + 0.01),
    ("presence_penalty", -MAX_PENALTY, -MAX_PENALTY - 0.01),
    ("frequency_penalty", MAX_PENALTY, MAX_PENALTY + 0.01),
    ("top_k", 0, -1),
    ("top_k", MAX_TOP_K, MAX_TOP_K + 1),
    ("seed", 0, -1),
    ("seed", MAX_SEED, MAX_SEED + 1),
    ("max_tokens", 1, 0),
    ("max_tokens", MAX_TOKENS_CAP, MAX_TOKENS_CAP + 1),
    ("top_logprobs", MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 1),
]


def refusal(fields: dict, defaults: dict | None = None) -> str:
    with pytest.raises(ProtocolError) as error:
        SamplingParams.from_request(fields, defaults)
    assert error.value.code == "bad_request"
    return error.value.message


@pytest.mark.parametrize(("name", "inside", "outside"), EDGES)
def test_a_value_at_a_bound_passes_and_one_past_it_is_refused(name, inside, outside):
    """Each bound is inclusive and exact: the control shows the check can fail."""
    assert getattr(SamplingParams.from_request({name: inside}), name) == inside
    assert name in refusal({name: outside})


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(name, value):
    """NaN and infinities (JSON's `NaN`, `Infinity`, `1e999`) never pass."""
    assert refusal({name: value}) == f"{name} must be a finite number"


@pytest.mark.parametrize("name", [*FLOATS, "top_k", "seed", "max_tokens"])
def test_huge_integers_are_refused_without_overflow(name):
    """An integer too large for a float is out of range, not an OverflowError."""
    assert name in refusal({name: 10**400})


def test_temperature_is_greedy_or_warm_enough():
    """Between 0 and the minimum, logits / T would overflow: refused, naming both."""
    message = refusal({"temperature": 1e-30})
    assert message == "temperature must be 0 (greedy) or from 0.01 to 2"


def test_whole_floats_count_as_integers():
    """JSON writers may send 42.0 for 42; 1e300 is whole, and far out of range."""
    assert SamplingParams.from_request({"seed": 42.0}).seed == 42
    assert "seed must be at most 4294967295" in refusal({"seed": 1e300})
    assert "seed must be a whole number" in refusal({"seed": 1.5})


def test_stop_strings_are_bounded_in_count_and_length():
    """8 stop strings of 256 characters pass; a 9th, or a 257th character, not."""
    longest = "x" * MAX_STOP_CHARS
    params = SamplingParams.from_request({"stop": [longest] * MAX_STOP_STRINGS})
    assert params.stop == (longest,) * MAX_STOP_STRINGS
    assert "stop strings" in refusal({"stop": ["x"] * (MAX_STOP_STRINGS + 1)})
    assert "stop string is at most" in refusal({"stop": [longest + "x"]})


@pytest.mark.parametrize("bad", ["a\x00b", "\ud800", "x\udfff"])
def test_text_with_nul_or_lone_surrogate_is_refused(bad):
    """NUL cuts a C string short; a lone surrogate cannot be encoded as UTF-8."""
    assert refusal({"stop": [bad]}).startswith("stop ")
    with pytest.raises(ProtocolError) as error:
        validate_messages(
            [{"role": "user", "content": "hi"}, {"role": "user", "content": bad}]
        )
    assert error.value.message.startswith("messages[1].content ")
    with pytest.raises(ProtocolError) as error:
        validate_messages([{"role": bad, "content": "hi"}])
    assert error.value.message.startswith("messages[0].role ")


def test_valid_unicode_passes():
    """Control: astral characters (a surrogate pair in JSON) are fine."""
    assert validate_messages([{"role": "user", "content": "😀 é"}])
    assert SamplingParams.from_request({"stop": ["😀"]}).stop == ("😀",)


def test_message_count_is_capped():
    one = {"role": "user", "content": "x"}
    assert len(validate_messages([one] * MAX_MESSAGES)) == MAX_MESSAGES
    with pytest.raises(ProtocolError):
        validate_messages([one] * (MAX_MESSAGES + 1))


def test_request_fields_override_defaults_and_null_takes_the_default():
    """Request over model default over ours; a null field is not an override."""
    defaults = {"temperature": 0.5, "top_k": 7}
    params = SamplingParams.from_request({"temperature": None, "top_k": 3}, defaults)
    assert (params.temperature, params.top_k) == (0.5, 3)


def test_a_bad_default_is_blamed_on_the_model():
    """A default the admin saved before the bounds existed fails with a message
    that says it is the model's default, unless the request overrides it."""
    defaults = {"temperature": 1e-30}
    message = refusal({"prompt": "x"}, defaults)
    assert message.startswith("the model's default sampling is invalid: temperature")
    assert SamplingParams.from_request({"temperature": 0}, defaults).temperature == 0
    # A fault in the request itself is the request's, even beside a bad default.
    assert refusal({"top_p": 2}, defaults) == "top_p must be at most 1"


numbers = (
    st.integers(-(2**70), 2**70)
    | st.floats()
    | st.sampled_from([0, 1, 0.01, 0.005, 2, 2.0001, MAX_SEED, MAX_SEED + 1, -1])
)
values = (
    st.none()
    | st.booleans()
    | numbers
    | st.text(max_size=5)
    | st.lists(st.text(max_size=300), max_size=10)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
sampling_dicts = st.dictionaries(
    st.sampled_from([*SAMPLING_FIELDS, "prompt", "other"]), values, max_size=8
)


def within_bounds(params: SamplingParams) -> None:
    assert params.temperature == 0 or (
        MIN_TEMPERATURE <= params.temperature <= MAX_TEMPERATURE
    )
    assert 0 <= params.top_p <= 1 and 0 <= params.min_p <= 1
    assert MIN_REPEAT_PENALTY <= params.repeat_penalty <= MAX_REPEAT_PENALTY
    assert abs(params.presence_penalty) <= MAX_PENALTY
    assert abs(params.frequency_penalty) <= MAX_PENALTY
    assert 0 <= params.top_k <= MAX_TOP_K
    assert params.seed is None or 0 <= params.seed <= MAX_SEED
    assert 1 <= params.max_tokens <= MAX_TOKENS_CAP
    assert 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS
    assert len(params.stop) <= MAX_STOP_STRINGS
    for stop in params.stop:
        assert 0 < len(stop) <= MAX_STOP_CHARS and "\x00" not in stop
        stop.encode("utf-8")
    floats = [getattr(params, name) for name in FLOATS]
    assert all(isinstance(v, float) and math.isfinite(v) for v in floats)


@settings(max_examples=400, deadline=None)
@given(sampling_dicts, sampling_dicts)
def test_from_request_fuzz(message, defaults):
    """Any JSON-ish request over any defaults: parameters within every bound, or
    a `bad_request`; never another exception."""
    try:
        params = SamplingParams.from_request(message, defaults)
    except ProtocolError as error:
        assert error.code == "bad_request"
    else:
        within_bounds(params)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), values, max_size=6))
def test_admin_defaults_are_checked_by_the_engines_function(defaults):
    """A default the admin's validator accepts is one every request can be served
    with, and one it refuses fails a request that leaves it in place, with the
    same message: both are `check_sampling`."""
    from django.core.exceptions import ValidationError

    from catalog.models import SAMPLING_KEYS, validate_sampling

    defaults = {k: v for k, v in defaults.items() if k in SAMPLING_KEYS}
    try:
        validate_sampling(defaults)
    except ValidationError as error:
        admin_refusal = error.messages[0]
    else:
        admin_refusal = None
    try:
        within_bounds(SamplingParams.from_request({"prompt": "x"}, defaults))
    except ProtocolError as error:
        prefix = "the model's default sampling is invalid: "
        assert error.message.startswith(prefix)
        assert admin_refusal is not None
        assert admin_refusal.endswith(error.message.removeprefix(prefix))
    else:
        # The admin refuses nulls the engine reads as "unset"; nothing else.
        assert admin_refusal is None or None in defaults.values()
