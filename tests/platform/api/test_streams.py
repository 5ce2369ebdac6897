"""Streams that end early: the front's ASGI handler (as uvicorn calls it) and a
real engine serving SmolLM2 with one slot. However a stream ends (the caller
hanging up while waiting for admission, in the engine's queue, while the headers
are sent, before the first token or mid-stream; the engine dying or going
silent), its key's concurrency slot comes back, the engine drops the request,
and its usage row records the prompt's tokens (counted by the engine when a slot
took the request, in its start frame) and the completion's tokens already sent.
The response's status leaves once the engine admitted the request into a slot:
a request that times out in the engine's queue is a 429."""

import asyncio
import json
import os
import signal
import threading

import pytest
from asgiref.sync import sync_to_async

from api.models import Usage
from engines.wire import client as engine_client
from engines.wire.requests import GenerateRequest
from tests.factories import ApiKeyFactory
from tests.platform.api.chat_front import (
    CHAT,
    DEADLINE_S,
    ENGINE,
    ESSAY,
    chat_engine,
    chat_scope,
    engine_idle,
    routed_to,
    slot_free,
    within,
)
from tests.platform.api.limit_checks import GatedRedis
from tests.waiting import await_for

pytestmark = pytest.mark.django_db(transaction=True)

# About 330 tokens: the engine takes a while over it before the first token.
LONG_PROMPT = " ".join(["The harbour is quiet tonight."] * 50)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine, one slot: a second request waits in its queue."""
    engine = chat_engine(tmp_path_factory.mktemp("streams"))
    yield engine
    engine.stop()


@pytest.fixture
def front(engine, tmp_path, settings, own_gateway):
    return routed_to(engine, tmp_path, settings, own_gateway)


class Caller:
    """One streamed chat request as the server hands it to the ASGI app, and
    the caller's side of it: what came back, and a hang-up the test makes."""

    def __init__(
        self, key: str, *, stall_headers: bool = False, content: str = ESSAY
    ) -> None:
        body = {
            "model": CHAT,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        }
        self._request: bytes | None = json.dumps(body).encode()
        self.scope = chat_scope(key, self._request)
        # A caller whose socket takes no more once the headers are written:
        # the handler's send waits there until it is cancelled.
        self.stall_headers = stall_headers
        self.status: int | None = None
        self.chunks: list[bytes] = []
        self.headers_sent = asyncio.Event()
        self.chunk_arrived = asyncio.Event()
        self._gone = asyncio.Event()

    async def receive(self) -> dict:
        if self._request is not None:
            body, self._request = self._request, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers_sent.set()
            if self.stall_headers:
                await asyncio.Event().wait()
        elif message.get("body"):
            self.chunks.append(message["body"])
            self.chunk_arrived.set()

    def hang_up(self) -> None:
        self._gone.set()

    async def chunks_received(self, count: int) -> None:
        while len(self.chunks) < count:
            self.chunk_arrived.clear()
            await within(self.chunk_arrived.wait())

    def events(self) -> list[str]:
        text = b"".join(self.chunks).decode()
        return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


async def usage_row(key) -> Usage:
    """The key's usage row, once the writer has stored it."""
    return await await_for(
        lambda: Usage.objects.filter(key_id=key.pk).afirst(),
        timeout=DEADLINE_S,
        what="the key's usage row",
    )


async def stream_key():
    return await sync_to_async(ApiKeyFactory)(max_concurrent=1)


async def prompt_tokens(engine, content: str = ESSAY) -> int:
    """What the engine counts for a chat request with this one message."""
    request = GenerateRequest(
        model=CHAT, messages=[{"role": "user", "content": content}], max_tokens=1
    )
    reply = await asyncio.to_thread(engine.client().generate, request)
    return reply.usage.prompt_tokens


def occupy(engine):
    """A direct stream that holds the engine's one slot until closed."""
    occupying = engine.client().generate_stream(
        GenerateRequest(model=CHAT, prompt="Long", max_tokens=500, ignore_eos=True)
    )
    next(occupying)  # the start frame: it has the slot
    return occupying


async def queued(engine) -> None:
    """Wait until a request of the model waits in the engine's queue."""

    def waiting() -> bool:
        models = engine.client().state().models
        return next(m for m in models if m.name == CHAT).queued == 1

    await await_for(
        lambda: asyncio.to_thread(waiting),
        timeout=DEADLINE_S,
        what="the request queued",
    )


async def test_hang_up_while_the_headers_are_sent(front, engine):
    """The caller goes away while the response's headers are being written,
    before the body is ever asked for: the slot, the engine's request and the
    usage row are settled all the same (Django closes the response)."""
    key = await stream_key()
    caller = Caller(key.plaintext, stall_headers=True)
    answering = asyncio.create_task(front(caller.scope, caller.receive, caller.send))
    await within(caller.headers_sent.wait())
    caller.hang_up()
    await within(answering)
    assert caller.chunks == []
    await slot_free(key)
    await engine_idle(engine)
    row = await usage_row(key)
    assert (row.status, row.error_code) == (499, "client_closed")
    assert row.prompt_tokens == await prompt_tokens(engine)


async def test_hang_up_while_queued_in_the_engine(front, engine):
    """The engine's one slot is busy: the request waits in its queue, with no
    answer yet (the status leaves at admission). The caller hangs up there:
    the engine drops the queued request; nothing was counted."""
    occupying = await asyncio.to_thread(occupy, engine)
    try:
        key = await stream_key()
        caller = Caller(key.plaintext)
        answering = asyncio.create_task(
            front(caller.scope, caller.receive, caller.send)
        )
        await queued(engine)
        assert caller.status is None
        caller.hang_up()
        await within(answering)
        assert caller.status is None
        await slot_free(key)
        row = await usage_row(key)
        assert (row.status, row.error_code) == (499, "client_closed")
        assert (row.prompt_tokens, row.completion_tokens) == (0, 0)
    finally:
        occupying.close()
    await engine_idle(engine)


async def test_hang_up_between_the_headers_and_the_first_token(front, engine):
    """The engine admitted the request (headers sent) and computes its long
    prompt: the caller hangs up before the first token. The row has the
    prompt's tokens, from the start frame, and no completion tokens."""
    expected = await prompt_tokens(engine, LONG_PROMPT)
    key = await stream_key()
    caller = Caller(key.plaintext, content=LONG_PROMPT)
    answering = asyncio.create_task(front(caller.scope, caller.receive, caller.send))
    await within(caller.headers_sent.wait())
    assert caller.status == 200
    caller.hang_up()
    await within(answering)
    assert caller.chunks == []
    await slot_free(key)
    await engine_idle(engine)
    row = await usage_row(key)
    assert (row.status, row.error_code) == (499, "client_closed")
    assert (row.prompt_tokens, row.completion_tokens) == (expected, 0)


async def test_a_queue_timeout_is_a_429_before_any_header(
    tmp_path, settings, own_gateway
):
    """The engine refuses a request that waited past its queue timeout, before
    any start frame: the caller gets a 429 with Retry-After, not a stream."""
    impatient = await asyncio.to_thread(chat_engine, tmp_path, queue_timeout_s=0.5)
    try:
        front = routed_to(impatient, tmp_path / "run", settings, own_gateway)
        occupying = await asyncio.to_thread(occupy, impatient)
        try:
            key = await stream_key()
            caller = Caller(key.plaintext)
            await within(front(caller.scope, caller.receive, caller.send))
        finally:
            occupying.close()
    finally:
        await asyncio.to_thread(impatient.stop)
    assert caller.status == 429
    error = json.loads(b"".join(caller.chunks))["error"]
    assert error["code"] == "overloaded"
    row = await usage_row(key)
    assert (row.status, row.error_code) == (429, "overloaded")
    await slot_free(key)


async def test_hang_up_mid_stream_records_the_tokens_sent(front, engine):
    """A stream cut short gets no final usage from the engine: the row counts
    the tokens streamed so far (each chunk carries at least one)."""
    key = await stream_key()
    caller = Caller(key.plaintext)
    answering = asyncio.create_task(front(caller.scope, caller.receive, caller.send))
    await caller.chunks_received(3)
    caller.hang_up()
    await within(answering)
    await slot_free(key)
    await engine_idle(engine)
    row = await usage_row(key)
    assert (row.status, row.error_code) == (499, "client_closed")
    assert row.prompt_tokens == await prompt_tokens(engine)
    assert 3 <= row.completion_tokens < 400
    assert row.engine == ENGINE


async def test_hang_up_while_waiting_for_admission(
    front,
    redis_limits,
    monkeypatch,
):
    """With the limits in Redis, the caller goes away while its slot is being
    counted (in a thread): the count runs on, and is given back."""
    gated = GatedRedis(monkeypatch)
    key = await stream_key()
    caller = Caller(key.plaintext)
    answering = asyncio.create_task(front(caller.scope, caller.receive, caller.send))
    try:
        assert await asyncio.to_thread(gated.entered.wait, DEADLINE_S)
        caller.hang_up()
        await within(answering)
    finally:
        gated.proceed.set()
    assert caller.status is None  # no answer started
    await slot_free(key)
    row = await usage_row(key)
    assert (row.status, row.error_code) == (499, "client_closed")


async def test_an_engine_gone_silent_mid_stream_is_504(front, engine, monkeypatch):
    """The engine stops answering (stopped with SIGSTOP) mid-stream: the
    stream ends with a 504 error event, and the row has the tokens sent."""
    # The front waits this long for each frame: long enough for any token of
    # a warm engine on a busy machine, short enough for a test.
    request = GenerateRequest(model=CHAT, prompt="Hi", max_tokens=1)
    await asyncio.to_thread(engine.client().generate, request)
    monkeypatch.setattr(engine_client, "REQUEST_TIMEOUT_S", 5.0)
    key = await stream_key()
    caller = Caller(key.plaintext)
    answering = asyncio.create_task(front(caller.scope, caller.receive, caller.send))
    await caller.chunks_received(3)
    os.kill(engine.process.pid, signal.SIGSTOP)
    try:
        await within(answering)
    finally:
        os.kill(engine.process.pid, signal.SIGCONT)
    error = json.loads(caller.events()[-1])["error"]
    assert error["code"] == "engine_timeout"
    row = await usage_row(key)
    assert (row.status, row.error_code) == (504, "engine_timeout")
    assert row.prompt_tokens > 0
    assert row.completion_tokens >= 3
    await slot_free(key)
    await engine_idle(engine)


async def test_an_engine_dead_mid_stream_is_502(tmp_path, settings, own_gateway):
    """The engine is killed mid-stream: the stream ends with a 502 error event,
    and the row has the tokens sent."""
    doomed = await asyncio.to_thread(chat_engine, tmp_path)
    try:
        front = routed_to(doomed, tmp_path / "run", settings, own_gateway)
        key = await stream_key()
        caller = Caller(key.plaintext)
        answering = asyncio.create_task(
            front(caller.scope, caller.receive, caller.send)
        )
        await caller.chunks_received(3)
        doomed.process.kill()
        await within(answering)
    finally:
        await asyncio.to_thread(doomed.stop)
    error = json.loads(caller.events()[-1])["error"]
    assert error["code"] == "engine_died"
    row = await usage_row(key)
    assert (row.status, row.error_code) == (502, "engine_died")
    assert row.prompt_tokens > 0
    assert row.completion_tokens >= 3
    await slot_free(key)


def test_the_occupying_stream_helper_holds_the_slot(engine):
    """The control for the tests of a hang-up in the engine's queue and of a
    queue timeout: while the direct stream runs, a request of the model waits
    in the engine's queue."""
    occupying = occupy(engine)
    waiting = threading.Thread(
        target=lambda: engine.client().generate(
            GenerateRequest(model=CHAT, prompt="Hi", max_tokens=1)
        )
    )
    waiting.start()
    try:
        asyncio.run(queued(engine))  # the helper the tests use
    finally:
        occupying.close()
        waiting.join(DEADLINE_S)
