"""Which failed requests are sent to another engine (api.pipeline.with_engine),
with real engine processes serving SmolLM2: only a request that never reached
an engine (nothing listens on its port, or the engine is stopping and says so)
is tried on another replica; a request whose engine died while serving it is
answered `engine_died` and sent nowhere else (it may be what killed it)."""

import asyncio
import json
import os
import signal
import socket

import pytest

from api.calls import Call
from api.errors import ApiError
from api.pipeline import with_engine
from engines.wire.client import write_connection_file
from engines.wire.framing import auth_frame, recv_frame
from engines.wire.requests import GenerateRequest
from routing.select import EngineStatus, ModelRoute, Snapshot
from tests.engines.conftest import EngineProcess, free_port, start_engine
from tests.engines.generating import gguf_spec
from tests.waiting import wait_for

CHAT = "smollm2-135m-instruct"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROUTE = ModelRoute(name=CHAT, format="gguf", task="chat", replicas=2)
# Long enough that the engine is still decoding when it is killed.
TALE = GenerateRequest(model=CHAT, prompt="A long tale:", max_tokens=2000)
TALE = TALE.model_copy(update={"ignore_eos": True})


def smol_spec() -> dict:
    return gguf_spec(CHAT, SMOL_FILE, context_length=2048, slots=1)


@pytest.fixture
def replicas(tmp_path, settings):
    """Two engines holding SmolLM2, `ra` (routed first) and `rb`, as the
    front finds them (connection files in its run dir), and the snapshot
    that names them."""
    settings.RUN_DIR = tmp_path
    engines = [
        start_engine(tmp_path, models=[smol_spec()], preload=[CHAT]) for _ in "ab"
    ]
    for name, engine in zip(("ra", "rb"), engines, strict=True):
        write_connection_file(tmp_path, name=name, port=engine.port, token=engine.token)
    statuses = {
        name: EngineStatus(
            name,
            "cpu",
            frozenset({"gguf"}),
            True,
            order=order,
            resident=frozenset({CHAT}),
            incarnation="t1",
        )
        for order, name in enumerate(("ra", "rb"))
    }
    snapshot = Snapshot(engines=statuses, models={CHAT: ROUTE})
    yield engines, snapshot
    for engine in engines:
        engine.stop()


def asked(tried: list[str]):
    """An attempt that generates the tale, noting each engine it is sent to."""

    async def attempt(client):
        tried.append(client.name)
        return await client.generate(TALE)

    return attempt


async def kill_once_decoding(engine: EngineProcess) -> None:
    """SIGKILL the engine once a slot of it is decoding a request."""

    def decoding() -> bool:
        return engine.client().state().slots_in_use >= 1

    await asyncio.to_thread(wait_for, decoding, timeout=60, what="the tale decoding")
    os.kill(engine.process.pid, signal.SIGKILL)


async def test_a_request_whose_engine_died_serving_it_is_not_sent_to_another(
    replicas,
):
    """Engine ra is killed while it decodes the request: the caller gets 502
    engine_died, and the request was sent to ra only (before: it was sent
    to rb next, which a poison input would kill in turn)."""
    (a, b), snapshot = replicas
    tried: list[str] = []
    killer = asyncio.ensure_future(kill_once_decoding(a))
    with pytest.raises(ApiError) as failed:
        await with_engine(
            Call("completions", route=ROUTE, snapshot=snapshot), asked(tried)
        )
    await killer
    assert (failed.value.status, failed.value.code) == (502, "engine_died")
    assert "failed while serving" in failed.value.message
    assert tried == ["ra"]
    assert b.client().state().slots_in_use == 0  # rb never had it


async def test_a_request_no_engine_took_is_sent_to_the_next_replica(replicas, tmp_path):
    """Control: ra does not accept connections (its file names a port
    nothing listens on): the request goes to rb and is answered there."""
    (a, b), snapshot = replicas
    write_connection_file(tmp_path, name="ra", port=free_port(), token="x" * 64)
    tried: list[str] = []
    short = TALE.model_copy(update={"max_tokens": 4})

    async def attempt(client):
        tried.append(client.name)
        return await client.generate(short)

    answer = await with_engine(
        Call("completions", route=ROUTE, snapshot=snapshot), attempt
    )
    assert tried == ["ra", "rb"]
    assert answer.usage.completion_tokens == 4


async def test_a_stopping_engine_says_so_without_reading_the_request(replicas):
    """A connection the engine accepted before it was told to stop, whose
    request arrives after: the engine answers `unreachable` without reading
    it (the front then sends it to another replica), where it used to close
    the connection unanswered, which reads as an engine that died with the
    request (not retried). A long request keeps the engine draining."""
    (a, b), snapshot = replicas
    busy = asyncio.ensure_future(a.aclient().generate(TALE))  # holds a's drain
    await asyncio.to_thread(
        wait_for,
        lambda: a.client().state().slots_in_use >= 1,
        timeout=60,
        what="a busy",
    )
    with socket.create_connection(("127.0.0.1", a.port), timeout=30) as late:
        a.client().call("shutdown")
        request = TALE.model_copy(update={"max_tokens": 4})
        late.sendall(auth_frame(a.token) + request.encoded())
        reply = json.loads(recv_frame(late))
    assert (reply["status"], reply["code"]) == ("error", "unreachable")
    assert "stopping" in reply["message"]
    busy.cancel()
