"""The REST edge applies the engines' own bounds: a value the engine would refuse
is a 400 naming its field before any engine is asked, and one it takes passes.
Every schema is fuzzed through `parse()`: a model or a 400, never a 500."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import ApiError
from api.openapi import openapi_document
from api.schemas import (
    ENDPOINT_SCHEMAS,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    body_fields,
    parse,
)
from engines.wire.bounds import (
    MAX_PENALTY,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOKENS_CAP,
    MIN_TEMPERATURE,
    check_sampling,
)
from engines.wire.errors import ProtocolError
from engines.wire.framing import decode_message
from engines.wire.requests import (
    ENVELOPE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_TOOLS_CHARS,
    parse_request,
    request_bytes,
    tools_chars,
)
from tests.engines.wire.frames import split_frames

FUZZ = settings(max_examples=300, deadline=None)


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def refusal(raw: bytes, schema=CompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as error:
        parse(schema, raw)
    assert error.value.status == 400
    return error.value


EDGES = [
    ("temperature", 0, -1e-9),
    ("temperature", MIN_TEMPERATURE, MIN_TEMPERATURE / 2),
    ("temperature", MAX_TEMPERATURE, MAX_TEMPERATURE + 1e-9),
    ("top_p", 0, -1e-9),
    ("top_p", 1, 1 + 1e-9),
    ("presence_penalty", -MAX_PENALTY, -MAX_PENALTY - 0.01),
    ("frequency_penalty", MAX_PENALTY, MAX_PENALTY + 0.01),
    ("seed", 0, -1),
    ("seed", MAX_SEED, MAX_SEED + 1),
    ("max_tokens", 1, 0),
    ("max_tokens", MAX_TOKENS_CAP, MAX_TOKENS_CAP + 1),
    ("stop", ["x"] * MAX_STOP_STRINGS, ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop", "x" * MAX_STOP_CHARS, "x" * (MAX_STOP_CHARS + 1)),
]


@pytest.mark.parametrize(("name", "inside", "outside"), EDGES)
def test_a_value_at_a_bound_passes_and_one_past_it_is_a_400(name, inside, outside):
    """The edge's bounds are the engine's, to the same value (control included)."""
    assert getattr(parse(CompletionRequest, body(**{name: inside})), name) == inside
    assert refusal(body(**{name: outside})).param == name


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty"])
def test_non_finite_numbers_are_400s(name, literal):
    """JSON bodies can carry NaN and infinities; none passes the edge."""
    raw = b'{"model": "m", "prompt": "hi", "%s": %s}' % (name.encode(), literal)
    error = refusal(raw)
    assert error.param == name
    assert "finite number" in error.message


@pytest.mark.parametrize(
    ("schema", "fields", "param"),
    [
        (CompletionRequest, {"prompt": "a\x00b"}, "prompt"),
        (CompletionRequest, {"prompt": ["a\x00b"]}, "prompt"),
        (CompletionRequest, {"stop": ["ok", "\x00"]}, "stop"),
        (CompletionRequest, {"user": "\x00"}, "user"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "\x00"}]},
            "messages.0.content",
        ),
        (
            ChatCompletionRequest,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "\x00"}]}
                ]
            },
            "messages.0.content.0.text",
        ),
        (EmbeddingRequest, {"input": ["fine", "a\x00"]}, "input"),
    ],
)
def test_nul_characters_are_400s_naming_the_field(schema, fields, param):
    """NUL would cut the text short in llama.cpp (and PostgreSQL refuses it)."""
    fields = {"model": "m", **fields}
    error = refusal(json.dumps(fields).encode(), schema)
    assert error.param == param
    assert "NUL character" in error.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m", "prompt": "bad \\ud800"}', "prompt"),
        (b'{"model": "m", "prompt": "hi", "stop": "\\udfff"}', "stop"),
        (b'{"model": "m", "input": ["ok", "\\udc00x"]}', "input.1"),
    ],
)
def test_lone_surrogates_are_400s(raw, param):
    """`\\ud800` in JSON is no character UTF-8 can hold: refused at the edge."""
    schema = EmbeddingRequest if b'"input"' in raw else CompletionRequest
    error = refusal(raw, schema)
    assert error.param == param
    assert "Unicode" in error.message


def test_surrogate_pairs_pass():
    """Control: an escaped astral character is one valid character."""
    assert parse(CompletionRequest, b'{"model": "m", "prompt": "\\ud83d\\ude00"}')


def test_an_empty_prompt_is_a_400():
    """The engine refuses an empty prompt: so does the edge, in either form."""
    assert refusal(body(prompt="")).param == "prompt"
    assert refusal(body(prompt=[""])).param == "prompt.0"
    assert parse(CompletionRequest, body(prompt=" "))  # control


def test_chat_messages_are_capped_in_total():
    """Many messages each under the cap, together over it: a 400 on `messages`."""
    half = "x" * (MAX_PROMPT_CHARS // 2 + 1)
    messages = [{"role": "user", "content": half}] * 2
    raw = json.dumps({"model": "m", "messages": messages}).encode()
    assert refusal(raw, ChatCompletionRequest).param == "messages"
    raw = json.dumps({"model": "m", "messages": messages[:1]}).encode()
    assert parse(ChatCompletionRequest, raw)


def tools_of_size(total: int, count: int = 4) -> list[dict]:
    """`count` tools whose size, as the engines count it (tools_chars), is
    `total` characters."""
    tools = [
        {"name": f"tool_{i}", "description": "", "parameters": {"type": "object"}}
        for i in range(count)
    ]
    spare = total - tools_chars(tools)
    for i, tool in enumerate(tools):
        tool["description"] = "d" * (spare // count + (i < spare % count))
    assert tools_chars(tools) == total
    return [{"type": "function", "function": tool} for tool in tools]


def test_tools_are_capped_in_total():
    """Tools each under their own caps, together over MAX_TOOLS_CHARS: a 400
    on `tools`; at the cap exactly, accepted (the control)."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    over = json.dumps({**chat, "tools": tools_of_size(MAX_TOOLS_CHARS + 1)})
    error = refusal(over.encode(), ChatCompletionRequest)
    assert error.param == "tools"
    assert f"over the cap of {MAX_TOOLS_CHARS}" in error.message
    at = json.dumps({**chat, "tools": tools_of_size(MAX_TOOLS_CHARS)})
    assert len(parse(ChatCompletionRequest, at.encode()).tools) == 4


def calls_history(size: int) -> list[dict]:
    """A chat whose earlier turns' tool calls make its engine request `size`
    bytes (each turn's own caps kept: calls' arguments are not prompt text)."""

    def chat(arguments: list[str]) -> list[dict]:
        turns = [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {"name": "f", "arguments": text},
                    }
                ],
            }
            for i, text in enumerate(arguments)
        ]
        return [*turns, {"role": "user", "content": "hi"}]

    def engine_size(messages: list[dict]) -> int:
        raw = json.dumps({"model": "m", "messages": messages}).encode()
        [request] = parse(ChatCompletionRequest, raw).engine_requests()
        return request_bytes(body_fields(request))

    pieces = ["a" * MAX_PROMPT_CHARS] * (size // MAX_PROMPT_CHARS)
    pieces.append("")
    # Measured short of the cap; one more "a" is one more byte.
    pieces[-1] = "a" * (size - engine_size(chat(pieces)))
    return chat(pieces)


def test_a_whole_request_is_capped():
    """Fields each within their caps, the engine request they make over
    MAX_REQUEST_BYTES (less the pipeline's room): a 400 naming the field
    that holds most of it; at that size exactly, accepted (the control)."""
    limit = MAX_REQUEST_BYTES - ENVELOPE_BYTES
    raw = json.dumps({"model": "m", "messages": calls_history(limit + 1)}).encode()
    error = refusal(raw, ChatCompletionRequest)
    assert error.param == "messages"
    assert f"over the cap of {limit}" in error.message
    raw = json.dumps({"model": "m", "messages": calls_history(limit)}).encode()
    request = parse(ChatCompletionRequest, raw)
    assert request_bytes(body_fields(request.engine_requests()[0])) == limit


# -- the document states the rules -----------------------------------------------

jsonschema_rs = pytest.importorskip("jsonschema_rs")  # schemathesis' validator

# Bodies at the rules the document states: each is refused by the edge iff the
# document refuses it, so that generated requests (schemathesis) need no
# workaround of their own. Each rule has a control that passes.
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]
DOCUMENTED = [
    ("/v1/completions", {"max_tokens": MAX_TOKENS_CAP}, True),
    ("/v1/completions", {"max_tokens": MAX_TOKENS_CAP + 1}, False),
    ("/v1/chat/completions", {"max_completion_tokens": MAX_TOKENS_CAP}, True),
    ("/v1/chat/completions", {"max_completion_tokens": MAX_TOKENS_CAP + 1}, False),
    ("/v1/chat/completions", {"max_tokens": MAX_TOKENS_CAP + 1}, False),
    ("/v1/completions", {"prompt": "x"}, True),
    ("/v1/completions", {"prompt": ""}, False),
    ("/v1/completions", {"prompt": [""]}, False),
    ("/v1/completions", {"temperature": 0}, True),
    ("/v1/completions", {"temperature": MIN_TEMPERATURE}, True),
    ("/v1/completions", {"temperature": MAX_TEMPERATURE}, True),
    ("/v1/completions", {"temperature": MIN_TEMPERATURE / 2}, False),
    ("/v1/completions", {"temperature": MAX_TEMPERATURE + 0.01}, False),
    ("/v1/completions", {"prompt": "a\x00b"}, False),
    ("/v1/completions", {"prompt": ["a\x00b"]}, False),
    ("/v1/completions", {"stop": "\x00"}, False),
    ("/v1/completions", {"user": "u\x00"}, False),
    ("/v1/completions", {"model": "m\x00"}, False),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "\x00"}]},
        False,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\x00"}]}]},
        False,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "name": "\x00"}]},
        False,
    ),
    ("/v1/embeddings", {"input": ["ok", "a\x00"]}, False),
    ("/v1/embeddings", {"input": ["ok", "a\x01"]}, True),
]


def documented_body(endpoint: str, fields: dict) -> dict:
    base = {
        "/v1/completions": {"model": "m", "prompt": "hi"},
        "/v1/chat/completions": {"model": "m", "messages": CHAT_MESSAGES},
        "/v1/embeddings": {"model": "m", "input": "hi"},
    }[endpoint]
    return {**base, **fields}


@pytest.mark.parametrize(("endpoint", "fields", "valid"), DOCUMENTED)
def test_the_document_states_the_bounds_the_edge_applies(endpoint, fields, valid):
    """/v1/openapi.json refuses what the edge refuses, at the same values: the
    engine's max_tokens bound, a prompt of at least one character, temperature
    0 or from MIN_TEMPERATURE, no NUL character in any text."""
    schema = ENDPOINT_SCHEMAS[endpoint]
    document = openapi_document()
    validator = jsonschema_rs.Draft202012Validator(
        {
            "$ref": f"#/components/schemas/{schema.__name__}",
            "components": document["components"],
        }
    )
    request = documented_body(endpoint, fields)
    assert validator.is_valid(request) is valid
    raw = json.dumps(request).encode()
    if valid:
        assert parse(schema, raw)
    else:
        refusal(raw, schema)


# -- the edge and the engine agree ----------------------------------------------

numbers = (
    st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(
        [0, 1, -1, 0.005, 0.01, 2, 2.000001, -2.01, MAX_SEED, MAX_SEED + 1, 1e300]
    )
)
stops = (
    st.none()
    | st.text(st.sampled_from("ab\x00é"), max_size=3)
    | st.lists(st.text(st.sampled_from("ab"), max_size=300), max_size=10)
)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": numbers,
        "top_p": numbers,
        "presence_penalty": numbers,
        "frequency_penalty": numbers,
        "seed": numbers,
        "max_tokens": numbers,
        "stop": stops,
    },
)


@FUZZ
@given(sampling)
def test_the_edge_accepts_exactly_what_the_engine_accepts(fields):
    """Over the sampling fields both speak, a 400 at the edge iff a bad_request
    at the engine: the two check the same bounds."""
    raw = body(**fields)
    try:
        request = parse(CompletionRequest, raw)
    except ApiError as error:
        assert error.status == 400
        edge = False
    else:
        edge = True
        [engine_request] = request.engine_requests()
    try:
        check_sampling(fields)
    except ProtocolError:
        engine = False
    else:
        engine = True
    assert edge == engine, (fields, edge, engine)
    if edge:
        check_sampling(body_fields(engine_request))  # what the edge forwards passes


# -- every schema, fuzzed ----------------------------------------------------------

texts = st.text(max_size=8) | st.text(st.sampled_from("a\x00\ud800é"), max_size=4)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3)
    ),
    max_leaves=12,
)
FIELD_NAMES = sorted(
    {name for schema in ENDPOINT_SCHEMAS.values() for name in schema.model_fields}
    | {"role", "content", "type", "text", "include_usage"}
)
bodies = (
    st.dictionaries(st.sampled_from(FIELD_NAMES) | texts, json_values, max_size=8).map(
        lambda value: json.dumps(value).encode()
    )
    | st.binary(max_size=64)
    | json_values.map(lambda value: json.dumps(value).encode())
)


@FUZZ
@given(st.sampled_from(sorted(ENDPOINT_SCHEMAS)), bodies)
def test_every_schema_fuzz(endpoint, raw):
    """Any body to any endpoint parses to its schema or is a 400, never a 500;
    what parses carries no text the engines would refuse, and the engine
    requests built from it (not checked again on the front) are ones the
    engine's own check takes."""
    schema = ENDPOINT_SCHEMAS[endpoint]
    try:
        request = parse(schema, raw)
    except ApiError as error:
        assert error.status == 400
        return
    if schema is EmbeddingRequest:
        fields = request.texts()
    else:
        fields = [body_fields(one) for one in request.engine_requests()]
        for one in request.engine_requests():
            check_sampling(body_fields(one))
            [payload] = split_frames(one.encoded())
            assert parse_request(decode_message(payload)) == one
    for text in strings(fields):
        assert "\x00" not in text
        text.encode("utf-8")
    json.dumps(fields, allow_nan=False)  # no NaN or infinity either


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
