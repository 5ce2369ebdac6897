"""The front routed to a real engine serving SmolLM2 with one slot, as the API's
stream tests and the WebSocket chat's drive it: the engine, the routing, a
request's scope and a chat longer than the context, and waits (on the engine
idle, on a key's slot back) with a deadline."""

import asyncio
import json

from api.limits import LimitExceeded, key_admission
from engines.wire.client import write_connection_file
from routing.select import EngineStatus, ModelRoute, Snapshot
from tests.engines.conftest import start_engine
from tests.engines.generating import gguf_spec
from tests.waiting import await_for

CHAT = "smollm2-135m-instruct"


ENGINE = "streams0"


DEADLINE_S = 30
# A function tool with one required argument, for tool-call answers.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


ESSAY = "Write a very long essay."


def chat_engine(log_dir, **limits):
    return start_engine(
        log_dir,
        models=[
            gguf_spec(
                CHAT,
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                slots=1,
                context_overflow="drop_oldest",
            )
        ],
        preload=[CHAT],
        limits=limits,
    )


def routed_to(engine, run_dir, settings, own_gateway):
    """The front's API handler, its requests routed to this engine: the
    engine's connection file in a run dir of the test's, and a snapshot in
    which it is up and serves the chat model."""
    write_connection_file(run_dir, name=ENGINE, port=engine.port, token=engine.token)
    settings.RUN_DIR = run_dir
    snapshot = Snapshot(
        engines={
            ENGINE: EngineStatus(
                ENGINE, "cpu", frozenset({"gguf"}), up=True, resident=frozenset({CHAT})
            )
        },
        models={CHAT: ModelRoute(CHAT, "gguf", task="chat")},
    )
    own_gateway(lambda: snapshot)
    from roundhouse.asgi import api_application

    return api_application


def chat_scope(
    key: str, payload: bytes, *, path: str = "/v1/chat/completions", method="POST"
) -> dict:
    """The ASGI scope of a request with this key and body (by default a POST
    /v1/chat/completions), as uvicorn hands it to the app."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("10.0.0.9", 40000),
        "server": ("127.0.0.1", 8000),
    }


async def asgi_request(
    app,
    key: str,
    path: str = "/v1/chat/completions",
    body: dict | None = None,
    *,
    timeout: float = DEADLINE_S,
) -> tuple[int, dict[str, str], bytes]:
    """One request through the ASGI app (a POST of `body`, or a GET): the
    status, the headers and the whole body. The caller stays connected until
    the answer is whole."""
    payload = b"" if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    scope = chat_scope(key, payload, path=path, method=method)
    sent = False
    answer: dict = {"status": 0, "headers": {}, "body": b""}
    complete = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {
                name.decode().lower(): value.decode()
                for name, value in message["headers"]
            }
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")
            if not message.get("more_body"):
                complete.set()

    await asyncio.wait_for(app(scope, receive, send), timeout)
    return answer["status"], answer["headers"], answer["body"]


def long_chat() -> list[dict]:
    """Sixteen question/answer turns and a last question: more than the
    engine's 512-token context."""
    messages = []
    for n in range(16):
        messages.append({"role": "user", "content": f"Tell me fact {n} about tides."})
        messages.append(
            {
                "role": "assistant",
                "content": f"Fact {n}: " + "tides rise and fall. " * 4,
            }
        )
    messages.append({"role": "user", "content": "And the last fact?"})
    return messages


async def within(awaitable):
    return await asyncio.wait_for(awaitable, DEADLINE_S)


async def slot_free(key) -> None:
    """Wait until the key (max_concurrent 1) is admitted again."""

    async def admitted() -> bool:
        try:
            async with key_admission(key):
                return True
        except LimitExceeded:
            return False

    await await_for(admitted, timeout=DEADLINE_S, what="the key's slot back")


async def engine_idle(engine) -> None:
    """Wait until the engine has no request of the model, running or queued."""

    def idle() -> bool:
        models = engine.client().state().models
        model = next(m for m in models if m.name == CHAT)
        return model.busy == 0 and model.queued == 0

    await await_for(
        lambda: asyncio.to_thread(idle), timeout=DEADLINE_S, what="the engine idle"
    )
