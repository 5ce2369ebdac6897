"""Anthropic's Messages API end to end: the official `anthropic` client against a
live front (uvicorn), with `manage.py supervise` running a real engine that
serves the bundled SmolLM2. The platform is started once for the module."""

import json
import urllib.error
import urllib.request
from email.message import Message

import anthropic
import pytest

from tests.platform import live_platform
from tests.platform.live_platform import CHAT, EMBEDDER, ENGINE, wait_for_usage
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# Greedy decoding. `temperature` is not among this client's arguments
# (Anthropic's newest models take no sampling settings); older clients send
# it, and Roundhouse honours it.
GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(live, key: str = "main") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=live.base_url,
        api_key=live.keys.get(key, key),
        max_retries=0,
        timeout=120,
    )


def post(live, path: str, body: dict, headers: dict) -> tuple[int, Message, bytes]:
    """A POST with exactly these headers: its status, headers and body."""
    request = urllib.request.Request(
        live.base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """A stream's events: each one's name and its data."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields["event"], json.loads(fields["data"])))
    return events


# -- answers -------------------------------------------------------------------


def test_a_message(live, orm):
    """A whole message in Anthropic's shape, its engine named in a header, and
    one usage row for the `messages` endpoint with its tokens."""
    raw = client(live).messages.with_raw_response.create(
        model=CHAT,
        max_tokens=8,
        system="You answer in one word.",
        messages=[{"role": "user", "content": "Name a colour."}],
        metadata={"user_id": "someone"},
        extra_body=GREEDY,
    )
    message = raw.parse()
    assert raw.headers["X-Roundhouse-Engine"] == ENGINE
    assert message.id.startswith("msg_")
    assert (message.type, message.role, message.model) == ("message", "assistant", CHAT)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    usage = message.usage
    assert 0 < usage.output_tokens <= 8
    prompt = usage.input_tokens + usage.cache_read_input_tokens
    assert prompt > 5
    row = wait_for_usage(endpoint="messages", key__name="main", status=200)
    assert (row.prompt_tokens, row.completion_tokens) == (prompt, usage.output_tokens)
    assert row.engine == ENGINE


def test_a_stream_joins_into_the_whole_message(live):
    """Greedy decoding: the streamed text deltas join into the whole answer,
    and the client's accumulated message matches it; the events come in
    Anthropic's order (message_start, ping, one text block's start, deltas
    and stop, message_delta with the stop reason and usage, message_stop)."""
    request = {
        "model": CHAT,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Count to five."}],
    }
    whole = client(live).messages.create(**request, extra_body=GREEDY)
    with client(live).messages.stream(**request, extra_body=GREEDY) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == whole.content[0].text == final.content[0].text
    assert len(deltas) > 1
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )

    status, headers, raw = post(
        live,
        "/v1/messages",
        {**request, **GREEDY, "stream": True},
        {"x-api-key": live.keys["main"]},
    )
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream"
    events = sse_events(raw)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"]) == ([], None)
    ended = events[-2][1]
    assert ended["delta"]["stop_reason"] == whole.stop_reason
    assert ended["usage"]["output_tokens"] == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_answer_and_is_named(live):
    """A stop sequence met mid-answer ends it there: stop_reason
    `stop_sequence`, the sequence named, whole and streamed. The control: the
    same request without it runs past that point."""
    request = {
        "model": CHAT,
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Write two sentences about dogs."}],
    }
    full = client(live).messages.create(**request, extra_body=GREEDY)
    text = full.content[0].text
    assert len(text) > 20
    assert full.stop_reason != "stop_sequence"
    stop = text[10:14]
    stopped = client(live).messages.create(
        **request, stop_sequences=[stop], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    with client(live).messages.stream(
        **request, stop_sequences=[stop], extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_a_tool_use_round_trip(live):
    """A forced tool choice answers with a `tool_use` block (stop_reason
    tool_use, the input an object of the schema); the message sent back as
    the assistant's turn with a `tool_result` gets a text answer. Streamed,
    the call's input comes as input_json_delta and adds up to the same."""
    request = {
        "model": CHAT,
        "max_tokens": 100,
        "messages": QUESTION,
        "tools": [WEATHER],
        "tool_choice": {
            "type": "tool",
            "name": "get_weather",
            "disable_parallel_tool_use": True,
        },
    }
    called = client(live).messages.create(**request, extra_body=GREEDY)
    assert called.stop_reason == "tool_use"
    uses = [block for block in called.content if block.type == "tool_use"]
    assert len(uses) == 1
    use = uses[0]
    assert use.name == "get_weather"
    assert isinstance(use.input, dict) and isinstance(use.input["city"], str)

    with client(live).messages.stream(**request, extra_body=GREEDY) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    partial = [
        e
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert partial
    streamed_uses = [block for block in streamed.content if block.type == "tool_use"]
    assert [(u.name, u.input) for u in streamed_uses] == [(use.name, use.input)]

    answered = client(live).messages.create(
        model=CHAT,
        max_tokens=20,
        tools=[WEATHER],
        extra_body=GREEDY,
        messages=[
            *QUESTION,
            {"role": "assistant", "content": called.content},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": "Sunny, 21 degrees.",
                    }
                ],
            },
        ],
    )
    assert answered.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answered.content] == ["text"]
    assert answered.content[0].text.strip()


def test_count_tokens_matches_the_prompt_of_the_same_request(live, orm):
    """count_tokens answers the prompt's tokens as the message's usage counts
    them (evaluated plus read from the cache), tools and system included; a
    usage row records the count_tokens call."""
    # api.tokenize (count_prompt_tokens) comes with the tokenize endpoints'
    # branch; until it is merged, this test skips.
    pytest.importorskip("api.tokenize", reason="api.tokenize not merged yet")
    request = {
        "model": CHAT,
        "system": "You check the weather.",
        "messages": QUESTION,
        "tools": [WEATHER],
    }
    counted = client(live).messages.count_tokens(**request)
    message = client(live).messages.create(**request, max_tokens=4)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    # The control: without the tools the prompt is shorter.
    fewer = client(live).messages.count_tokens(
        model=CHAT, system=request["system"], messages=QUESTION
    )
    assert 0 < fewer.input_tokens < counted.input_tokens
    wait_for_usage(endpoint="messages.count_tokens", key__name="main", status=200)


# -- keys and errors -------------------------------------------------------------


def test_the_key_is_taken_from_x_api_key_or_bearer(live):
    """`x-api-key` (Anthropic's header) and `Authorization: Bearer` both
    authenticate; neither is Anthropic's authentication_error."""
    body = {"model": CHAT, "max_tokens": 2, "messages": QUESTION}
    key = live.keys["main"]
    for headers in ({"x-api-key": key}, {"Authorization": f"Bearer {key}"}):
        status, _, raw = post(live, "/v1/messages", body, headers)
        assert status == 200, raw
        assert json.loads(raw)["type"] == "message"
    status, _, raw = post(live, "/v1/messages", body, {})
    assert status == 401
    assert json.loads(raw)["error"]["type"] == "authentication_error"


def test_errors_come_in_anthropics_shape(live):
    """A bad key: 401 authentication_error; an unknown model: 404
    not_found_error; max_tokens missing: 400 invalid_request_error naming it
    (the control: the same request with it succeeds); an image: 400 saying
    so; a wrong method: 405. Each body is {"type": "error", "error": ...}."""
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        client(live, "rh-not-a-key").messages.create(
            model=CHAT, max_tokens=2, messages=QUESTION
        )
    assert bad_key.value.status_code == 401
    assert bad_key.value.body["type"] == "error"
    assert bad_key.value.body["error"]["type"] == "authentication_error"

    with pytest.raises(anthropic.NotFoundError) as unknown:
        client(live).messages.create(
            model="no-such-model", max_tokens=2, messages=QUESTION
        )
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model" in unknown.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as wrong_task:
        client(live).messages.create(model=EMBEDDER, max_tokens=2, messages=QUESTION)
    assert wrong_task.value.body["error"]["type"] == "invalid_request_error"

    body = {"model": CHAT, "messages": QUESTION}
    with pytest.raises(anthropic.BadRequestError) as missing:
        client(live).post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    assert missing.value.status_code == 400
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    answered = client(live).post(
        "/v1/messages", body={**body, "max_tokens": 2}, cast_to=anthropic.types.Message
    )
    assert answered.type == "message"

    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    with pytest.raises(anthropic.BadRequestError) as unreadable:
        client(live).messages.create(
            model=CHAT,
            max_tokens=2,
            messages=[{"role": "user", "content": [image]}],
        )
    assert "image blocks are not supported" in unreadable.value.body["error"]["message"]

    status, headers, raw = live.get("/v1/messages")
    assert status == 405
    assert headers["Allow"] == "POST"
    assert json.loads(raw)["error"]["type"] == "invalid_request_error"


# -- hanging up ------------------------------------------------------------------


def test_hanging_up_mid_stream_frees_the_engine_slot(live, orm):
    """The client closes a long stream after a few deltas: the engine cancels
    the request (its slot is free long before 400 tokens could be made), and
    the usage row records a hang-up (499) on the messages endpoint."""
    engine = live.engine()
    with client(live).messages.stream(
        model=CHAT,
        max_tokens=400,
        messages=[{"role": "user", "content": "Write a very long essay."}],
    ) as stream:
        deltas = iter(stream.text_stream)
        for _ in range(3):
            next(deltas)
        assert engine.state().slots_in_use == 1  # the control: it is running
    wait_for(
        lambda: engine.state().slots_in_use == 0, timeout=30, what="the slot freed"
    )
    row = wait_for_usage(endpoint="messages", status=499)
    assert row.error_code == "client_closed"
    assert row.engine == ENGINE
    assert 0 < row.completion_tokens < 400
