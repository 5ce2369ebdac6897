"""One ASGI app, two servers: `roundhouse.asgi:application` serves HTTP, SSE
and the WebSocket chat under uvicorn (how `make run` serves it) and under
`daphne roundhouse.asgi:application`, against the live platform (supervisor,
real engine serving SmolLM2)."""

import json
import signal
import subprocess
import sys

import pytest
from websockets.sync.client import connect

from tests.conftest import ROOT
from tests.platform import live_platform
from tests.platform.live import free_port_block
from tests.platform.live_platform import CHAT, ENGINE
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live


@pytest.fixture(scope="module")
def daphne(live, tmp_path_factory):
    """The same app under Daphne, on a port of its own, beside uvicorn."""
    port = free_port_block(1)
    log = tmp_path_factory.mktemp("daphne") / "daphne.log"
    with open(log, "ab") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "daphne",
                "-b",
                "127.0.0.1",
                "-p",
                str(port),
                "roundhouse.asgi:application",
            ],
            cwd=ROOT,
            env=live.env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )

    def answering():
        try:
            status, _, _ = _get(port, "/healthz")
        except OSError:
            return False
        return status == 200

    try:
        wait_for(answering, timeout=60, what="daphne answering")
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _get(port: int, path: str):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.status, r.headers, r.read()


@pytest.fixture(params=["uvicorn", "daphne"])
def port(request, live):
    if request.param == "uvicorn":
        return live.port
    return request.getfixturevalue("daphne")


def test_http_and_sse(port, live):
    """/healthz, and a streamed chat completion as server-sent events."""
    status, _, body = _get(port, "/healthz")
    assert status == 200 and json.loads(body)["engines_ready"]
    client = live.client()
    client.base_url = f"http://127.0.0.1:{port}/v1"
    chunks = list(
        client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=5,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1])


def test_websocket_chat(port, live):
    """The WebSocket chat with an API key: ready, start, tokens, done."""
    with connect(f"ws://127.0.0.1:{port}/ws/chat/", open_timeout=30) as socket:
        socket.send(json.dumps({"type": "auth", "key": live.keys["main"]}))
        assert json.loads(socket.recv(timeout=30))["type"] == "ready"
        socket.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": "1",
                    "model": CHAT,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "params": {"max_tokens": 4},
                }
            )
        )
        received = []
        while not received or received[-1]["type"] not in ("done", "error"):
            received.append(json.loads(socket.recv(timeout=60)))
    assert received[0] == {
        "type": "start",
        "id": "1",
        "model": CHAT,
        "engine": ENGINE,
        "node": "",
        "dropped_messages": 0,
    }
    assert received[-1]["type"] == "done", received[-1]
    assert received[-1]["usage"]["completion_tokens"] == len(received) - 2


def test_websocket_from_another_site_is_refused(port):
    """A browser page of another origin cannot open the chat socket."""
    with pytest.raises(Exception) as refused:  # noqa: PT011 - servers differ
        with connect(
            f"ws://127.0.0.1:{port}/ws/chat/",
            origin="http://evil.test",
            open_timeout=30,
        ):
            pass
    assert "403" in str(refused.value) or "rejected" in str(refused.value).lower()
