"""Limits of the WebSocket chat, over real sockets (roundhouse.asgi's websocket
application) answered by a real engine serving SmolLM2 with one slot: a
logged-in user's limits (the admin's User limits, or the user's own) count
over all their sockets, a message with n choices weighs n, and what a stream
took is given back however it ends. A key's socket counts n against the key's
max_concurrent the same way."""

import dataclasses

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from api.limits import Allowance, LimitExceeded, admission
from api.models import UserLimitOverride, UserLimits
from api.selectors import user_allowance
from tests.factories import ApiKeyFactory
from tests.platform.api import conftest as api_conftest
from tests.platform.api.chat_front import DEADLINE_S, ESSAY, engine_idle
from tests.platform.chat.sockets import Socket, chat, keyed_socket
from tests.waiting import await_for

pytestmark = pytest.mark.django_db(transaction=True)

# The limits' clock, which the test sets.
clock = api_conftest.clock

LONG = {"max_tokens": 400, "temperature": 0}
SHORT = {"max_tokens": 4, "temperature": 0}


def logged_in(username: str) -> tuple[object, str]:
    """A user (made on first use) and the id of a new session logged in as it:
    each call is another login, as another browser's."""
    user, _ = get_user_model().objects.get_or_create(username=username)
    client = Client()
    client.force_login(user)
    return user, client.cookies["sessionid"].value


async def session_socket(app, username: str) -> tuple[object, Socket]:
    """An open, ready socket of a new login of this user."""
    user, session = await sync_to_async(logged_in)(username)
    socket = Socket(app, headers=[(b"cookie", f"sessionid={session}".encode())])
    assert await socket.open()
    assert (await socket.receive()) == {"type": "ready", "user": username}
    return user, socket


async def free_weight(allowance) -> int:
    """How much of this allowance's concurrency is free now: a probe in its
    counters that counts no request per minute."""
    probe = dataclasses.replace(allowance, rpm_limit=0)
    for weight in range(probe.max_concurrent, 0, -1):
        try:
            async with admission(probe, weight=weight):
                return weight
        except LimitExceeded:
            continue
    return 0


async def until_free(allowance, weight: int) -> None:
    """Wait until exactly `weight` of the allowance is free."""

    async def exactly() -> bool:
        return await free_weight(allowance) == weight

    await await_for(exactly, timeout=DEADLINE_S, what=f"exactly {weight} free")


async def allowance_of(user):
    return await sync_to_async(user_allowance)(user_id=user.pk)


def refused(message: dict, stream_id: str, code: str, status: int) -> None:
    assert message["type"] == "error", message
    assert (message["id"], message["code"], message["status"]) == (
        stream_id,
        code,
        status,
    )


async def test_a_user_is_limited_across_sockets_and_gets_the_limit_back(
    socket_app, engine
):
    """The default user limits (4 engine requests at once) hold over all of
    one user's sockets: with n=4 running on one, a message on another login's
    socket is refused (429, concurrency_limit_exceeded), another user's is
    not. What a stream took comes back when it is cancelled, when it ends and
    when its socket closes: each time the same user can send n=4 again."""
    user, first = await session_socket(socket_app, "ada")
    _, second = await session_socket(socket_app, "ada")
    allowance = await allowance_of(user)
    assert allowance.max_concurrent == 4
    await first.send(chat("a", ESSAY, params={**LONG, "n": 4}))
    await until_free(allowance, 0)
    await second.send(chat("b", params=SHORT))
    over = await second.receive()
    refused(over, "b", "concurrency_limit_exceeded", 429)
    assert over["retry_after"] == 1 and "your account" in over["message"]

    # Cancelled: given back.
    await first.send({"type": "cancel", "id": "a"})
    assert (await first.until("done", "a"))[-1]["finish_reason"] == "cancelled"
    await until_free(allowance, 4)
    # Ended: given back (the next n=4 is admitted).
    await second.send(chat("c", params={**SHORT, "n": 4}))
    assert (await second.until("done", "c"))[-1]["finish_reason"]
    await second.send(chat("d", ESSAY, params={**LONG, "n": 4}))
    await until_free(allowance, 0)
    # Its socket closed: given back.
    await second.close()
    await until_free(allowance, 4)
    await first.send(chat("e", params={**SHORT, "n": 4}))
    assert (await first.until("done", "e"))[-1]["finish_reason"]
    await first.close()
    await engine_idle(engine)


async def test_another_user_has_limits_of_their_own(socket_app, engine):
    """One user holding all of their concurrency does not limit another: the
    other's message is admitted (it holds 1 of its own 4) and, once the
    first user's socket has closed and freed the engine's one slot, answered."""
    user, busy = await session_socket(socket_app, "ada")
    other_user, other = await session_socket(socket_app, "bob")
    await busy.send(chat("a", ESSAY, params={**LONG, "n": 4}))
    await until_free(await allowance_of(user), 0)
    await other.send(chat("b", params=SHORT))
    await until_free(await allowance_of(other_user), 3)
    await busy.close()
    seen = await other.until("done", "b")
    assert [m["type"] for m in seen][0] == "start"
    await other.close()
    await engine_idle(engine)


async def test_a_user_over_requests_per_minute_is_refused(socket_app, engine, clock):
    """A user's own limit of 2 messages a minute, over two sockets: the
    third message in the minute is refused (429, rate_limit_exceeded, retry
    after the seconds left in the minute); the next minute it is answered."""
    user, first = await session_socket(socket_app, "cleo")
    _, second = await session_socket(socket_app, "cleo")
    await sync_to_async(UserLimitOverride.objects.create)(
        defaults=await sync_to_async(UserLimits.load)(),
        user=user,
        rpm_limit=2,
        max_concurrent=4,
    )
    clock.now = 1_800_000_000.0 + 15  # 45 s before the next minute
    await first.send(chat("one", params=SHORT))
    await first.until("stored", "one")
    await second.send(chat("two", params=SHORT))
    await second.until("stored", "two")
    await first.send(chat("three", params=SHORT))
    over = await first.receive()
    refused(over, "three", "rate_limit_exceeded", 429)
    assert over["retry_after"] == 45 and "2 requests per minute" in over["message"]
    clock.now += 60
    await first.send(chat("four", params=SHORT))
    assert (await first.until("done", "four"))[-1]["finish_reason"]
    await first.close()
    await second.close()


def save_user_limits_in_admin(*, user, max_concurrent: int) -> int:
    """Give the user their own limits on the admin's User limits page, as a
    staff member does; the response's status."""
    admin = get_user_model().objects.create_superuser("root", password="pw-not-real")
    client = Client()
    client.force_login(admin)
    defaults = UserLimits.load()
    response = client.post(
        reverse("admin:api_userlimits_change", args=[defaults.pk]),
        {
            "rpm_limit": defaults.rpm_limit,
            "max_concurrent": defaults.max_concurrent,
            "overrides-TOTAL_FORMS": "1",
            "overrides-INITIAL_FORMS": "0",
            "overrides-MIN_NUM_FORMS": "0",
            "overrides-MAX_NUM_FORMS": "1000",
            "overrides-0-user": user.pk,
            "overrides-0-rpm_limit": "60",
            "overrides-0-max_concurrent": str(max_concurrent),
        },
    )
    return response.status_code


async def test_n_above_the_whole_allowance_is_a_400_until_the_admin_raises_it(
    socket_app, engine
):
    """n=5 with the default 4 engine requests at once could never run: an
    error with status 400 (not a 429 to retry) that names n. Once the user
    has their own limit of 8, set on the admin's User limits page, the same
    message is answered."""
    user, socket = await session_socket(socket_app, "dora")
    await socket.send(chat("five", params={**SHORT, "n": 5}))
    heavy = await socket.receive()
    refused(heavy, "five", "concurrency_limit_exceeded", 400)
    assert "opens 5 engine requests" in heavy["message"]
    assert "(n)" in heavy["message"] and "retry_after" not in heavy
    status = await sync_to_async(save_user_limits_in_admin)(user=user, max_concurrent=8)
    assert status == 302
    await socket.send(chat("five-again", params={**SHORT, "n": 5}))
    done = (await socket.until("done", "five-again"))[-1]
    assert [c["index"] for c in done["choices"]] == [0, 1, 2, 3, 4]
    await socket.close()


async def test_a_keys_socket_counts_n_against_its_max_concurrent(socket_app, engine):
    """A key with 2 requests at once: n=3 is a 400 naming n; n=2 running on
    one of its sockets leaves no room for one more on another (429); once it
    is cancelled, n=2 is answered."""
    key = await sync_to_async(ApiKeyFactory)(max_concurrent=2)
    first = await keyed_socket(socket_app, key)
    second = await keyed_socket(socket_app, key)
    await first.send(chat("three", params={**SHORT, "n": 3}))
    heavy = await first.receive()
    refused(heavy, "three", "concurrency_limit_exceeded", 400)
    assert "opens 3 engine requests" in heavy["message"]
    await first.send(chat("held", ESSAY, params={**LONG, "n": 2}))
    await until_free(Allowance.of_key(key), 0)
    await second.send(chat("one", params=SHORT))
    refused(await second.receive(), "one", "concurrency_limit_exceeded", 429)
    await first.send({"type": "cancel", "id": "held"})
    await first.until("done", "held")
    await second.send(chat("two", params={**SHORT, "n": 2}))
    assert (await second.until("done", "two"))[-1]["choices"]
    await first.close()
    await second.close()
    await engine_idle(engine)
