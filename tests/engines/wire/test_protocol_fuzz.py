"""Fuzzing the engine's frame decoder and request validation with hypothesis:
whatever bytes arrive, the engine either gets a message it can serve or raises
its own protocol error, never another exception."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.wire.bounds import MAX_PROMPT_CHARS
from engines.wire.errors import FrameTooLarge, ProtocolError
from engines.wire.framing import HEADER, decode_message, encode_message, read_frame
from engines.wire.requests import parse_request

FUZZ = settings(max_examples=300, deadline=None)

# JSON values whose strings may hold NUL, lone surrogates (which JSON's \\ud800
# escape produces) and whose numbers may be NaN or infinite.
texts = st.text(max_size=12) | st.text(
    st.sampled_from(["\x00", "\ud800", "\udfff", "a", "é", "😀"]), max_size=6
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4)
    ),
    max_leaves=16,
)


def refused(call, *args) -> ProtocolError:
    with pytest.raises(ProtocolError) as error:
        call(*args)
    assert error.value.code == "bad_request"
    return error.value


@FUZZ
@given(st.binary(max_size=512))
def test_decoding_arbitrary_bytes(payload):
    """Arbitrary bytes decode to a JSON object or raise ProtocolError."""
    try:
        assert isinstance(decode_message(payload), dict)
    except ProtocolError as error:
        assert error.code == "bad_request"


@FUZZ
@given(st.dictionaries(texts, json_values, max_size=5))
def test_decoding_any_json_object(message):
    """Any JSON object (written with \\u escapes, NaN, lone surrogates) either
    decodes to a message the engine can encode back, or is a bad request."""
    payload = json.dumps(message).encode()
    try:
        decoded = decode_message(payload)
    except ProtocolError as error:
        assert error.code == "bad_request"
    else:
        encode_message(decoded)  # no string that UTF-8 cannot hold got through


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"a": ' + b"1" * 5000 + b"}", "malformed JSON"),
        (b'{"kind": "generate", "prompt": "\\ud800"}', "prompt is not valid Unicode"),
        (b'{"messages": [{"content": "ok\\uDC00"}]}', "messages[0].content"),
        (b'{"\\ud83d": 1}', "a key of the message"),
        (b"\xff\xfe", "malformed JSON"),
        (b"[1]", "must be a JSON object"),
    ],
)
def test_hostile_payloads_are_bad_requests(payload, needle):
    """Deep nesting, 5000-digit integers and lone surrogates: bad requests that
    name what is wrong (they raised RecursionError, ValueError, or got through)."""
    assert needle in refused(decode_message, payload).message


def test_escapes_that_are_valid_still_decode():
    """Controls: a surrogate pair, and an escaped backslash before `ud800`."""
    assert decode_message(b'{"t": "\\ud83d\\ude00"}') == {"t": "😀"}
    assert decode_message(b'{"t": "\\\\ud800"}') == {"t": "\\ud800"}


def read_all(data: bytes, max_bytes: int) -> list[bytes]:
    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        frames = []
        while (payload := await read_frame(reader, max_bytes=max_bytes)) is not None:
            frames.append(payload)
        return frames

    return asyncio.run(scenario())


@FUZZ
@given(st.binary(max_size=256) | st.lists(st.binary(max_size=40)).map(b"".join))
def test_read_frame_over_arbitrary_bytes(data):
    """A stream of arbitrary bytes yields whole frames, then a clean end; a header
    over the cap raises FrameTooLarge, and a stream cut inside a frame
    ConnectionError. Nothing else."""
    try:
        frames = read_all(data, max_bytes=64)
    except FrameTooLarge:
        return
    except ConnectionError as error:
        assert "connection closed inside a frame" in str(error)
        return
    assert b"".join(HEADER.pack(len(f)) + f for f in frames) == data


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_read_frame_returns_what_was_framed(payloads):
    """Control: well-framed payloads come back exactly."""
    data = b"".join(HEADER.pack(len(p)) + p for p in payloads)
    assert read_all(data, max_bytes=64) == payloads


requests = st.fixed_dictionaries(
    {"kind": st.sampled_from(["generate", "generate_stream", "embed", "cancel"])},
    optional={
        "model": json_values,
        "prompt": json_values | texts,
        "messages": json_values,
        "texts": st.lists(texts, max_size=4) | json_values,
        "request_id": json_values,
        "encoding": st.sampled_from(["json", "npy", "hex"]),
    },
)


@FUZZ
@given(requests)
def test_request_validation_fuzz(message):
    """Any request is a kind the engine serves, with text free of NUL and lone
    surrogates, or a `bad_request`."""
    try:
        kind = parse_request(message).kind
    except ProtocolError as error:
        assert error.code == "bad_request"
        return
    assert kind == message["kind"]
    served = {
        "generate": [message.get("prompt")],
        "generate_stream": [message.get("prompt")],
        "embed": message.get("texts"),
    }.get(kind, [])
    for text in served:
        if text is not None:
            assert "\x00" not in text and len(text) <= MAX_PROMPT_CHARS
            text.encode("utf-8")


@pytest.mark.parametrize(
    ("kind", "field", "clean", "bad", "needle"),
    [
        ("generate", "prompt", "ab", "a\x00b", "prompt must not contain a NUL"),
        ("generate", "prompt", "é", "\ud800", "prompt is not valid Unicode"),
        ("embed", "texts", ["ok", "x"], ["ok", "\x00"], "texts[1] must not"),
        ("embed", "texts", ["😀"], ["\udfff"], "texts[0] is not valid Unicode"),
    ],
)
def test_request_text_is_checked(kind, field, clean, bad, needle):
    """NUL and lone surrogates are refused naming the field; clean text passes."""
    message = {"kind": kind, "model": "m"}
    assert parse_request({**message, field: clean}).kind == kind
    assert needle in refused(parse_request, {**message, field: bad}).message
