"""The OpenAI-compatible API's failures end to end, as the official `openai`
client types them: bad keys and models, invalid fields, limits, no engine,
oversized bodies, and callers that hang up mid-stream. A live front (uvicorn,
as `make run` starts it) and `manage.py supervise` running a real engine, as
in test_openai.py, started once for the module."""

import http.client
import json
import time

import openai
import psutil
import pytest

from tests.platform import live_platform
from tests.platform.live_platform import (
    CHAT,
    EMBEDDER,
    ENGINE,
    UNSERVED,
    wait_for_usage,
)
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm


# -- errors, as the client library types them --------------------------------


def test_bad_and_revoked_keys_are_authentication_errors(live, orm):
    for key in ("rh-not-a-key", "revoked"):
        with pytest.raises(openai.AuthenticationError) as error:
            live.client(key).models.list()
        assert error.value.status_code == 401
    assert "revoked" in str(error.value)


def test_unknown_and_forbidden_models_are_not_found(live):
    with pytest.raises(openai.NotFoundError) as error:
        live.client().chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        live.client("embed-only").chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "hi"}]
        )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"messages": []}, "messages"),
        ({"n": 9}, "n"),
        ({"frobnicate": True}, "frobnicate"),
    ],
)
def test_invalid_fields_are_bad_requests_naming_the_field(live, fields, param):
    request = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}]}
    request.update(fields)
    with pytest.raises(openai.BadRequestError) as error:
        live.client().chat.completions.create(
            **{k: v for k, v in request.items() if k in ("model", "messages")},
            extra_body={k: v for k, v in request.items() if k not in ("model",)},
        )
    assert error.value.body["param"] == param
    assert param in error.value.body["message"]


def test_wrong_task_is_a_bad_request(live):
    with pytest.raises(openai.BadRequestError) as error:
        live.client().embeddings.create(model=CHAT, input="hi")
    assert error.value.body["code"] == "model_task_mismatch"


def test_rate_limit_is_429_with_retry_after(live):
    """The third request of a minute is refused (rpm 2). The limit counts in
    fixed one-minute windows: the requests are sent where at least 15 s of a
    minute are left, so that no new minute starts among them."""
    client = live.client("rpm")
    left = 60 - time.time() % 60
    if left < 15:
        time.sleep(left + 0.1)  # a clock condition, not a negative check
    for _ in range(2):
        client.models.list()  # listing is free: does not count
    for _ in range(2):
        client.embeddings.create(model=EMBEDDER, input="counted")
    with pytest.raises(openai.RateLimitError) as error:
        client.embeddings.create(model=EMBEDDER, input="one too many")
    retry_after = int(error.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 60


def test_concurrency_limit_is_429_while_a_stream_holds_the_slot(live):
    client = live.client("single")
    stream = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=400,
        stream=True,
    )
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as error:
        client.embeddings.create(model=EMBEDDER, input="second at once")
    assert "concurrent" in error.value.body["message"]
    stream.close()
    # The slot comes back when the stream ends.
    wait_for(
        lambda: _embeds(client), timeout=30, what="the key's concurrency slot back"
    )


def _embeds(client) -> bool:
    try:
        client.embeddings.create(model=EMBEDDER, input="again")
    except openai.RateLimitError:
        return False
    return True


def test_no_engine_for_the_format_is_503(live):
    with pytest.raises(openai.InternalServerError) as error:
        live.client().chat.completions.create(
            model=UNSERVED, messages=[{"role": "user", "content": "hi"}]
        )
    assert error.value.status_code == 503
    assert "no engine can serve transformers models" in error.value.body["message"]


def _partial_post(live, headers: dict, body: bytes) -> tuple[int, dict]:
    """POST /v1/embeddings sending only `body` after the headers (not
    necessarily all the headers announce); the status and JSON answer."""
    connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/embeddings")
        for name, value in {
            "Authorization": f"Bearer {live.keys['main']}",
            "Content-Type": "application/json",
            **headers,
        }.items():
            connection.putheader(name, value)
        connection.endheaders()
        connection.send(body)
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


def test_oversized_body_is_413_before_it_is_read(live):
    """The declared size alone is refused: the answer comes while the client
    has sent 9 bytes of the 17 MiB it announced."""
    declared = 17 * 1024 * 1024
    status, body = _partial_post(live, {"Content-Length": declared}, b'{"model":')
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert str(declared) in body["error"]["message"]


def test_chunked_body_over_the_cap_is_413(live):
    """A chunked body declares no size: it is refused once it goes over (the
    client stops one byte past the cap, never sending the last chunk)."""
    piece = b"a" * (1024 * 1024)
    cap = 16 * 1024 * 1024  # ROUNDHOUSE_MAX_REQUEST_BYTES' default
    pieces = [piece] * (cap // len(piece)) + [b"a"]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    status, body = _partial_post(live, {"Transfer-Encoding": "chunked"}, chunks)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert "exceeds the limit" in body["error"]["message"]


# -- disconnects -----------------------------------------------------------


def test_disconnect_mid_stream_frees_the_engine_slot(live, orm):
    """The client hangs up after a few tokens of a long answer: the engine
    cancels it (its slot is free long before 400 tokens could be made)."""
    engine = live.engine()
    stream = live.client().chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Write a very long essay."}],
        max_tokens=400,
        stream=True,
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert engine.state().slots_in_use == 1
    stream.close()
    wait_for(
        lambda: engine.state().slots_in_use == 0,
        timeout=10,
        what="the slot freed",
    )
    log = (live.run_dir / "logs").glob("*.log")
    assert any("went away: cancelled" in p.read_text() for p in log)
    row = wait_for_usage(endpoint="chat.completions", status=499)
    assert row.error_code == "client_closed"
    assert row.engine == ENGINE


def test_the_serving_front_never_loaded_an_ml_library(live):
    """After answering chat, completions and embeddings, the front's process has
    no torch, transformers or llama.cpp library mapped."""
    live.client().embeddings.create(model=EMBEDDER, input="one more")

    def heavy_libraries(pid: int) -> list[str]:
        mapped = {m.path for m in psutil.Process(pid).memory_maps()}
        assert mapped
        return [p for p in mapped if any(n in p for n in ("torch", "llama_cpp"))]

    assert heavy_libraries(live.front_pid) == []
    assert heavy_libraries(live.engine().state().pid)  # the probe does see them
