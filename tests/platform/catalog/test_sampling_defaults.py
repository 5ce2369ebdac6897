"""A model's default sampling, set in the admin, is checked against the engines'
own bounds when it is saved, so a bad default is refused there with a clear
message instead of failing every request to the model."""

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog.models import SAMPLING_KEYS, ModelConfig, validate_sampling
from engines.wire.bounds import check_sampling
from engines.wire.errors import ProtocolError
from tests.factories import ModelConfigFactory
from tests.platform.catalog.model_form import model_add


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"temperature": 1e-30}, "temperature must be 0 (greedy) or from 0.01 to 2"),
        ({"top_p": 0}, None),
        ({"top_p": 1.5}, "top_p must be at most 1"),
        ({"seed": 2**32}, "seed must be at most 4294967295"),
        ({"seed": 2**32 - 1}, None),
        ({"repeat_penalty": 0}, "repeat_penalty must be at least 0.01"),
        ({"presence_penalty": -2}, None),
        ({"presence_penalty": -2.5}, "presence_penalty must be at least -2"),
        ({"top_k": 1001}, "top_k must be at most 1000"),
        ({"max_tokens": 0}, "max_tokens must be positive"),
        ({"temperature": None}, "temperature must be a number"),
        ({"stop": ["x"]}, "unknown parameter 'stop'"),
    ],
)
def test_defaults_are_checked_against_the_engine_bounds(sampling, message):
    """Values at a bound pass; past it, the engine's own message is the error."""
    if message is None:
        validate_sampling(sampling)
        return
    with pytest.raises(ValidationError) as error:
        validate_sampling(sampling)
    assert message in error.value.messages[0]


@pytest.mark.django_db
def test_full_clean_puts_the_error_on_the_sampling_field():
    """The service layer's full_clean() refuses a bad default, on its field."""
    model = ModelConfigFactory.build(sampling={"temperature": float("nan")})
    with pytest.raises(ValidationError) as error:
        model.full_clean()
    assert error.value.message_dict["sampling"] == [
        "temperature must be a finite number"
    ]


@pytest.mark.django_db
def test_the_admin_refuses_a_bad_default(admin_client):
    """The add form shows the engine's message and saves nothing; a good
    default saves (the control)."""
    response = model_add(admin_client, sampling='{"temperature": 0.001, "top_k": 40}')
    assert response.status_code == 200
    assert (
        "temperature must be 0 (greedy) or from 0.01 to 2" in response.content.decode()
    )
    assert not ModelConfig.objects.filter(name="qwen-test").exists()

    response = model_add(admin_client, sampling='{"temperature": 0.01, "top_k": 40}')
    assert response.status_code == 302
    saved = ModelConfig.objects.get(name="qwen-test").sampling
    assert saved == {"temperature": 0.01, "top_k": 40}
    assert reverse("admin:catalog_modelconfig_changelist") in response["Location"]


@pytest.mark.django_db
def test_the_admin_refuses_nan_in_the_json(admin_client):
    """Python's JSON reader takes NaN and Infinity; the default still must not."""
    response = model_add(admin_client, sampling='{"top_p": NaN}')
    assert response.status_code == 200
    assert "top_p must be a finite number" in response.content.decode()


numbers = st.integers(-(2**40), 2**40) | st.floats() | st.sampled_from([0.005, 2**32])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(SAMPLING_KEYS), numbers, max_size=5))
def test_the_admin_and_the_engine_agree(defaults):
    """A default passes the admin iff it passes the engine's check."""
    try:
        check_sampling(defaults)
    except ProtocolError as error:
        with pytest.raises(ValidationError) as refused:
            validate_sampling(defaults)
        assert refused.value.messages == [error.message]
    else:
        validate_sampling(defaults)
