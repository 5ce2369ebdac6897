"""A chat turn's id over the WebSocket (`turn_id`): a turn sent again, as
the chat page does after a reconnect, is stored once. Driven through the
front's WebSocket application (origin check, session auth, routes) with
Channels' WebsocketCommunicator, answered by a real engine serving SmolLM2."""

import pytest
from asgiref.sync import sync_to_async

from chat.models import Conversation, Message
from tests.platform.api.chat_front import DEADLINE_S, ESSAY
from tests.platform.chat.sockets import Socket, chat, session_cookie
from tests.waiting import await_for

pytestmark = pytest.mark.django_db(transaction=True)

LONG = {"max_tokens": 400, "temperature": 0}
SHORT = {"max_tokens": 6, "temperature": 0}


async def session_socket(app, session: str) -> Socket:
    socket = Socket(
        app,
        headers=[
            (b"cookie", f"sessionid={session}".encode()),
            (b"origin", b"http://127.0.0.1:8000"),
        ],
    )
    assert await socket.open()
    assert (await socket.receive())["type"] == "ready"
    return socket


async def answers(user) -> int:
    return await Message.objects.filter(
        conversation__user=user, role="assistant"
    ).acount()


async def interrupted(app, session: str, user, turn: dict) -> None:
    """Send `turn` and close the socket once its answer streams; return once
    the server has stored the interrupted answer."""
    before = await answers(user)
    socket = await session_socket(app, session)
    await socket.send(turn)
    await socket.until("token", turn["id"])
    await socket.close()

    async def stored() -> bool:
        return await answers(user) != before

    await await_for(stored, timeout=DEADLINE_S, what="the interrupted answer stored")


async def answered(app, session: str, turn: dict) -> list[dict]:
    """Send `turn` on a new socket: its messages up to `stored`."""
    socket = await session_socket(app, session)
    await socket.send(turn)
    seen = await socket.until("stored", turn["id"])
    await socket.close()
    return seen


async def turns(conversation: int) -> list[tuple[str, str]]:
    """The conversation's messages: role and finish reason."""
    return [
        (m.role, m.finish_reason)
        async for m in Message.objects.filter(conversation_id=conversation)
    ]


async def test_a_new_conversations_turn_sent_again_is_stored_once(socket_app):
    """A new conversation's first turn is interrupted (the socket closes
    mid-answer; the server stores it), then sent again on a new socket with
    the same turn id and no conversation (the page never heard which): it
    streams again, and `stored` names the same conversation, which holds one
    user message and the finished answer in place of the interrupted one.
    The control: the same two sends without a turn id store two
    conversations."""
    user, session = await sync_to_async(session_cookie)("ada")
    await interrupted(
        socket_app, session, user, chat("s1", ESSAY, params=LONG, turn_id="t-1")
    )
    first = await Conversation.objects.aget(user=user)
    assert await turns(first.pk) == [("user", ""), ("assistant", "")]

    seen = await answered(
        socket_app, session, chat("s1", ESSAY, params=SHORT, turn_id="t-1")
    )
    assert [m["type"] for m in seen if m["type"] != "token"] == [
        "start",
        "done",
        "stored",
    ]
    assert seen[-1]["conversation"] == first.pk
    assert await Conversation.objects.filter(user=user).acount() == 1
    assert await turns(first.pk) == [("user", ""), ("assistant", "length")]

    # The control: without a turn id, the turn sent again is stored again.
    await interrupted(socket_app, session, user, chat("s2", "Other", params=LONG))
    await answered(socket_app, session, chat("s2", "Other", params=SHORT))
    assert await Conversation.objects.filter(user=user).acount() == 3


async def test_a_later_turn_sent_again_is_stored_once(socket_app):
    """In a stored conversation, a second turn interrupted and sent again
    with its turn id and the conversation: the conversation holds each turn
    once (user, answer, user, answer), the second answer the finished one.
    The control: another turn without a turn id, sent twice, is added
    twice."""
    user, session = await sync_to_async(session_cookie)("bea")
    seen = await answered(
        socket_app, session, chat("a", "Hello there", params=SHORT, turn_id="one")
    )
    conversation = seen[-1]["conversation"]
    second = chat("b", ESSAY, params=LONG, turn_id="two", conversation=conversation)
    second["messages"][:0] = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
    ]
    await interrupted(socket_app, session, user, second)
    seen = await answered(socket_app, session, {**second, "params": SHORT})
    assert seen[-1]["conversation"] == conversation
    assert await turns(conversation) == [("user", ""), ("assistant", "length")] * 2

    third = {**second, "id": "c", "params": SHORT}
    del third["turn_id"]
    await answered(socket_app, session, third)
    await answered(socket_app, session, third)
    assert [role for role, _ in await turns(conversation)] == [
        "user",
        "assistant",
    ] * 4


async def test_a_turn_id_is_short_and_plain(socket_app):
    """A turn id of other characters, or over 64 of them, is refused with
    `bad_request` naming `turn_id`, and the socket stays: the same chat with
    a plain id is answered (the control)."""
    user, session = await sync_to_async(session_cookie)("cid")
    socket = await session_socket(socket_app, session)
    for bad in ("has space", "x" * 65, "", "é"):
        await socket.send(chat("s", params=SHORT, turn_id=bad))
        error = await socket.receive()
        assert (error["type"], error["code"]) == ("error", "bad_request")
        assert "'turn_id'" in error["message"]
    await socket.send(chat("s", params=SHORT, turn_id="A-z_09"))
    assert (await socket.until("stored", "s"))[-1]["conversation"]
    await socket.close()
