"""The WebSocket chat (`/ws/chat/`) as the front routes it (origin check,
session auth, URL routes: roundhouse.asgi's websocket application), driven by
Channels' WebsocketCommunicator, answered by a real engine serving SmolLM2
with one slot: a second stream waits in its queue."""

import dataclasses
import json

import pytest
from asgiref.sync import sync_to_async

from api.gateway import front_gateway
from api.models import ApiKey, Usage
from api.schemas import ChatCompletionRequest, parse
from chat.consumers import ChatConsumer
from chat.models import Conversation, Message
from tests.factories import ApiKeyFactory, ModelConfigFactory
from tests.platform.api.chat_front import (
    CHAT,
    DEADLINE_S,
    ESSAY,
    WEATHER_TOOL,
    engine_idle,
    long_chat,
    slot_free,
)
from tests.platform.chat.sockets import Socket, chat, keyed_socket, session_cookie
from tests.waiting import await_for

pytestmark = pytest.mark.django_db(transaction=True)


async def usage_of(**filters) -> Usage:
    return await await_for(
        lambda: Usage.objects.filter(**filters).afirst(),
        timeout=DEADLINE_S,
        what=f"a usage row {filters}",
    )


async def test_key_chat_streams_and_is_recorded(socket_app, engine):
    """A key's socket: start, tokens, done with usage and timings; one usage
    row (endpoint ws.chat) and the turn stored as the key's conversation."""
    key = await sync_to_async(ApiKeyFactory)()
    socket = await keyed_socket(socket_app, key)
    await socket.send(chat("a"))
    messages = await socket.until("done", "a")
    start, *tokens, done = messages
    # Then, the answer over, where its turn was stored.
    (where,) = await socket.until("stored", "a")
    assert start == {
        "type": "start",
        "id": "a",
        "model": CHAT,
        "engine": "streams0",
        "node": "",
        "dropped_messages": 0,
    }
    assert tokens and all(t["type"] == "token" and t["id"] == "a" for t in tokens)
    assert done["finish_reason"] in ("stop", "length")
    assert done["usage"]["completion_tokens"] == len(tokens)
    assert done["usage"]["prompt_tokens"] > 5
    assert done["timings"]["first_token_ms"] > 0
    assert done["timings"]["engine"] == "streams0"
    row = await usage_of(key_id=key.pk)
    assert (row.endpoint, row.status, row.model) == ("ws.chat", 200, CHAT)
    assert row.completion_tokens == len(tokens)
    conversation = await Conversation.objects.aget(pk=where["conversation"])
    assert conversation.key_id == key.pk and conversation.user_id is None
    stored = [m async for m in Message.objects.filter(conversation=conversation)]
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[1].content == "".join(t["text"] for t in tokens)
    assert stored[1].engine == "streams0"
    assert stored[1].completion_tokens == len(tokens)
    await socket.close()


async def test_no_authentication_closes_with_4401(socket_app, monkeypatch):
    """Silence, a first message that is not `auth`, or a wrong key: closed
    with 4401 and a reason. Control: the right key is answered `ready`."""
    monkeypatch.setattr(ChatConsumer, "AUTH_TIMEOUT_S", 0.2)
    silent = Socket(socket_app)
    assert await silent.open()
    closed = await silent.receive()
    assert closed["code"] == 4401 and "authentication" in closed["reason"]

    monkeypatch.setattr(ChatConsumer, "AUTH_TIMEOUT_S", 30)
    for first in (chat("x"), {"type": "auth", "key": "rh-wrong"}, "not json"):
        socket = Socket(socket_app)
        assert await socket.open()
        await socket.send(first)
        closed = await socket.receive()
        assert closed["type"] == "closed" and closed["code"] == 4401, first
        assert closed["reason"]

    key = await sync_to_async(ApiKeyFactory)()
    socket = await keyed_socket(socket_app, key)
    await socket.close()


async def test_malformed_messages_get_bad_request_and_the_socket_stays(
    socket_app, engine
):
    """Bad JSON, unknown types and fields, and sampling values REST refuses:
    an `error` with code bad_request (REST's own message), and the socket
    still serves a good chat afterwards."""
    key = await sync_to_async(ApiKeyFactory)()
    socket = await keyed_socket(socket_app, key)
    bad_temperature = chat("t", params={"temperature": 5})
    rest_body = {
        "model": CHAT,
        "messages": bad_temperature["messages"],
        "temperature": 5,
    }
    with pytest.raises(Exception) as rest:
        parse(ChatCompletionRequest, json.dumps(rest_body).encode())
    for sent, stream_id, says in (
        ("{not json", None, "not valid JSON"),
        ({"type": "dance"}, None, "Unknown message type"),
        ({**chat("u"), "colour": 1}, "u", "colour"),
        (chat("p", params={"stream": False}), "p", "params argument supplied: stream"),
        (bad_temperature, "t", rest.value.message),
        ({**chat("e"), "messages": []}, "e", "messages"),
    ):
        await socket.send(sent)
        error = await socket.receive()
        assert error["type"] == "error" and error["code"] == "bad_request", sent
        assert error["status"] == 400
        assert error["id"] == stream_id
        assert says in error["message"]
    await socket.send(chat("ok"))
    assert (await socket.until("done", "ok"))[-1]["finish_reason"]
    await socket.close()


async def test_key_limits_apply_as_on_rest(socket_app, engine):
    """The key's models and requests per minute: model_not_found, then
    rate_limit_exceeded with retry_after (REST's Retry-After)."""
    key = await sync_to_async(ApiKeyFactory)(rpm_limit=1)
    socket = await keyed_socket(socket_app, key)
    await socket.send(chat("first"))
    await socket.until("stored", "first")
    await socket.send(chat("second"))
    error = await socket.receive()
    assert error["code"] == "rate_limit_exceeded" and error["status"] == 429
    assert error["retry_after"] >= 1 and error["id"] == "second"
    await socket.close()

    other = await sync_to_async(_key_for_another_model)()
    socket = await keyed_socket(socket_app, other)
    await socket.send(chat("m"))
    error = await socket.receive()
    assert (error["code"], error["status"]) == ("model_not_found", 404)
    await socket.close()


def _key_for_another_model() -> ApiKey:
    return ApiKeyFactory(allowed_models=[ModelConfigFactory(name="another-model")])


async def test_cancel_frees_the_slot_for_the_next_stream(socket_app, engine):
    """Two streams on one socket, the engine with one slot: the second waits.
    Cancelling the first ends it with `done` (cancelled) and its slot goes to
    the second, which streams to its end."""
    key = await sync_to_async(ApiKeyFactory)()
    socket = await keyed_socket(socket_app, key)
    long = {"max_tokens": 400, "temperature": 0}
    await socket.send(chat("one", ESSAY, params=long))
    await socket.until("token", "one")
    await socket.send(chat("two", ESSAY, params={"max_tokens": 4}))
    await socket.send({"type": "cancel", "id": "one"})
    seen = await socket.until("done", "one")
    assert seen[-1]["finish_reason"] == "cancelled"
    assert seen[-1]["usage"]["completion_tokens"] >= 1
    rest = await socket.until("done", "two")
    assert [m["type"] for m in rest if m.get("id") == "two"][0] == "start"
    assert rest[-1]["usage"]["completion_tokens"] <= 4
    cancelled = await usage_of(key_id=key.pk, error_code="cancelled")
    assert cancelled.status == 499
    await socket.close()
    await engine_idle(engine)


async def test_closed_socket_cancels_its_streams_in_the_engine(socket_app, engine):
    """A socket closed mid-stream: the engine drops the request, the key's
    slot comes back, the usage row says the client went away."""
    key = await sync_to_async(ApiKeyFactory)(max_concurrent=1)
    socket = await keyed_socket(socket_app, key)
    await socket.send(chat("gone", ESSAY, params={"max_tokens": 400}))
    await socket.until("token", "gone")
    await socket.close()
    await engine_idle(engine)
    await slot_free(key)
    row = await usage_of(key_id=key.pk)
    assert (row.status, row.error_code) == (499, "client_closed")
    assert row.completion_tokens >= 1


async def test_session_user_chats_and_owns_the_conversation(socket_app, engine):
    """A logged-in browser (session cookie, its own origin): ready at once;
    the usage row and the conversation are the user's; a later turn continues
    the conversation; another user's conversation is refused."""
    user, session = await sync_to_async(session_cookie)("ada")
    headers = [
        (b"cookie", f"sessionid={session}".encode()),
        (b"origin", b"http://127.0.0.1:8000"),
    ]
    socket = Socket(socket_app, headers=headers)
    assert await socket.open()
    assert (await socket.receive()) == {"type": "ready", "user": "ada"}
    await socket.send(chat("s1", "Hello there"))
    conversation = (await socket.until("stored", "s1"))[-1]["conversation"]
    turn = chat("s2", "And again", conversation=conversation)
    turn["messages"].insert(0, {"role": "user", "content": "Hello there"})
    await socket.send(turn)
    assert (await socket.until("stored", "s2"))[-1]["conversation"] == conversation
    stored = [
        m.role async for m in Message.objects.filter(conversation_id=conversation)
    ]
    assert stored == ["user", "assistant", "user", "assistant"]
    row = await usage_of(user_id=user.pk)
    assert row.endpoint == "ws.chat" and row.key_id is None

    other, other_session = await sync_to_async(session_cookie)("bob")
    intruder = Socket(
        socket_app,
        headers=[(b"cookie", f"sessionid={other_session}".encode())],
    )
    assert await intruder.open()
    await intruder.receive()
    await intruder.send(chat("x", conversation=conversation))
    error = await intruder.receive()
    assert error["code"] == "conversation_not_found"
    await intruder.close()
    await socket.close()


async def test_other_sites_cannot_use_the_session(socket_app):
    """A page of another origin is refused before the consumer runs; the
    same socket from an allowed origin is accepted (the control)."""
    _, session = await sync_to_async(session_cookie)("eve")
    cookie = (b"cookie", f"sessionid={session}".encode())
    foreign = Socket(socket_app, headers=[cookie, (b"origin", b"http://evil.test")])
    assert not await foreign.open()
    own = Socket(socket_app, headers=[cookie, (b"origin", b"http://localhost:8000")])
    assert await own.open()
    await own.close()


async def test_a_refused_stream_refreshes_the_fleet_snapshot(
    socket_app, monkeypatch, own_gateway
):
    """While the front's snapshot shows the engine down, a stream is refused
    (no_engine, retry_after); that refusal starts a reload of the snapshot, as
    a REST answer does, so the engine that came back serves the next stream
    (else the old snapshot would be used until it is too old, 10 s)."""
    up = front_gateway().cache.get()
    down = dataclasses.replace(
        up,
        engines={
            name: dataclasses.replace(engine, up=False)
            for name, engine in up.engines.items()
        },
    )
    current = {"snapshot": down}
    cache = own_gateway(lambda: current["snapshot"], max_age_s=0.05).cache
    cache.get()
    current["snapshot"] = up  # the engine is back; the front has not looked
    # The snapshot in memory stale (older than max_age_s), not too old.
    await await_for(lambda: cache.fresh() is None, what="the snapshot stale")
    key = await sync_to_async(ApiKeyFactory)()
    socket = await keyed_socket(socket_app, key)
    await socket.send(chat("while-down"))
    error = await socket.receive()
    assert (error["code"], error["retry_after"]) == ("no_engine", 5)

    await await_for(
        lambda: cache.peek()[0] is up, timeout=DEADLINE_S, what="the snapshot reloaded"
    )
    await socket.send(chat("after"))
    assert (await socket.until("done", "after"))[-1]["finish_reason"]
    await socket.close()


async def test_a_conversation_over_the_context_says_what_was_dropped(socket_app):
    """The engine's model drops the oldest turns of a chat longer than its
    512-token context: the `start` message says how many; the answer comes."""
    key = await sync_to_async(ApiKeyFactory)()
    socket = await keyed_socket(socket_app, key)
    message = chat("long")
    message["messages"] = long_chat()
    await socket.send(message)
    start, *_, done = await socket.until("done", "long")
    assert start["type"] == "start"
    assert 0 < start["dropped_messages"] < len(message["messages"]) - 1
    assert done["type"] == "done"
    await socket.close()


async def test_params_take_the_rest_fields(socket_app, engine):
    """`params` take REST's fields for the answer's shape: a JSON response
    format with log-probabilities and two choices (each token names its
    choice; `done` lists how each ended), and a forced tool call (`done`
    carries it; its deltas came in the tokens)."""
    key = await sync_to_async(ApiKeyFactory)()
    socket = await keyed_socket(socket_app, key)
    ask = 'Give JSON with keys "name" and "age" for Alice, who is 30.'
    params = {
        "max_tokens": 40,
        "temperature": 0,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_object"},
    }
    await socket.send(chat("j", ask, params=params))
    _, *tokens, done = await socket.until("done", "j")
    for index in (0, 1):
        mine = [t for t in tokens if t["index"] == index]
        assert isinstance(json.loads("".join(t["text"] for t in mine)), dict)
        assert all(
            len(entry["top_logprobs"]) == 2 for t in mine for entry in t["logprobs"]
        )
    assert [c["index"] for c in done["choices"]] == [0, 1]
    assert done["usage"]["completion_tokens"] == sum(len(t["logprobs"]) for t in tokens)
    params = {"max_tokens": 60, "temperature": 0, "tools": [WEATHER_TOOL]}
    params["tool_choice"] = "required"
    params["parallel_tool_calls"] = False
    await socket.send(chat("t", "Weather in Paris?", params=params))
    _, *tokens, done = await socket.until("done", "t")
    assert done["finish_reason"] == "tool_calls"
    [call] = done["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    deltas = [d for t in tokens for d in t.get("tool_calls", ())]
    assert deltas[0]["id"] == call["id"]
    assert (
        "".join(d["function"]["arguments"] for d in deltas)
        == (call["function"]["arguments"])
    )
    await socket.close()
