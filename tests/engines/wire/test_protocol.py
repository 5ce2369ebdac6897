"""The framed protocol: round trips, caps checked from the header, and a
hypothesis-driven fuzz of the decoder."""

import asyncio
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.wire.errors import FrameTooLarge, ProtocolError
from engines.wire.framing import (
    HEADER,
    decode_array,
    decode_message,
    encode_array,
    encode_message,
    read_frame,
)
from engines.wire.requests import parse_request
from tests.engines.wire.frames import split_frames

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)
messages = st.dictionaries(st.text(max_size=10), json_values, max_size=6)


@given(messages)
def test_message_round_trip(message):
    """Any JSON object survives encode → split → decode unchanged."""
    [payload] = list(split_frames(encode_message(message)))
    assert decode_message(payload) == message


@settings(max_examples=500)
@given(st.binary(max_size=256))
def test_decoder_fuzz_raises_only_protocol_errors(data):
    """Arbitrary bytes either decode to JSON objects or raise ProtocolError."""
    try:
        for payload in split_frames(data, max_bytes=1024):
            assert isinstance(decode_message(payload), dict)
    except ProtocolError as error:
        assert error.code == "bad_request"


@settings(max_examples=300)
@given(
    st.dictionaries(
        st.sampled_from(["kind", "model", "texts", "token", "config", "encoding"]),
        json_values,
        max_size=5,
    )
)
def test_request_validation_fuzz(message):
    """Any JSON object is either a valid request or a `bad_request`."""
    try:
        request = parse_request(message)
    except ProtocolError as error:
        assert error.code == "bad_request"
    else:
        assert request.kind == message["kind"]


def test_header_over_the_cap_is_refused_before_reading_the_payload():
    """The reader raises on the header alone; no payload bytes are awaited."""

    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data(HEADER.pack(10**12))  # header only, payload never sent
        with pytest.raises(FrameTooLarge):
            await asyncio.wait_for(read_frame(reader, max_bytes=1024), 1)

    asyncio.run(scenario())


def test_encoding_refuses_an_oversized_message():
    with pytest.raises(FrameTooLarge):
        encode_message({"text": "x" * 2048}, max_bytes=1024)


def test_arrays_round_trip_as_npy():
    """Arrays travel as .npy without pickle, exactly."""
    array = np.random.default_rng(1).standard_normal((5, 384)).astype(np.float32)
    restored = decode_array(encode_array(array))
    assert restored.dtype == np.float32
    np.testing.assert_array_equal(restored, array)


def test_object_arrays_are_refused():
    """A .npy payload that would need pickle is a bad request, never unpickled."""
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)  # noqa: S301
    with pytest.raises(ProtocolError, match="bad array"):
        decode_array(buffer.getvalue())
