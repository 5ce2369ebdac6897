"""The OpenAI-compatible API end to end: the official `openai` client against a
live front (uvicorn, as `make run` starts it), with `manage.py supervise` running
a real engine that serves the bundled SmolLM2 (chat) and MiniLM (embeddings).

The platform is started once for the module; tests reach the database through
`orm` (rows stay for the module: the front and the supervisor read them)."""

import base64
import json
import os
import re
import signal
import socket

import numpy as np
import openai

from catalog.models import ModelConfig
from tests.platform import live_platform
from tests.platform.live import free_port_block
from tests.platform.live_platform import (
    CHAT,
    EMBEDDER,
    ENGINE,
    UNSERVED,
    usage_rows,
    wait_for_usage,
)
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm


# -- the happy paths --------------------------------------------------------


def test_models_lists_each_configured_model_once(live):
    listed = [model.id for model in live.client().models.list()]
    assert listed == sorted([CHAT, EMBEDDER, UNSERVED])
    restricted = [model.id for model in live.client("embed-only").models.list()]
    assert restricted == [EMBEDDER]


def test_usage_reports_prompt_tokens_from_the_cache(live):
    """The same conversation again: all its prompt but the last token comes
    from the engine's prompt cache, reported as OpenAI does
    (usage.prompt_tokens_details.cached_tokens), streamed or not."""
    fields = {
        "model": CHAT,
        "messages": [{"role": "user", "content": "Describe a lighthouse at dusk."}],
        "max_tokens": 3,
        "temperature": 0,
    }
    first = live.client().chat.completions.create(**fields)
    again = live.client().chat.completions.create(**fields)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 1
    chunks = list(
        live.client().chat.completions.create(
            **fields, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    # The usage rows record it too.
    wait_for_usage(endpoint="chat.completions", key__name="main", cached_tokens=cached)
    _, _, body = live.get("/metrics")
    counted = re.search(
        rf'roundhouse_tokens_total{{engine="{ENGINE}",kind="prompt_cached",'
        rf'model="{CHAT}"}} (\S+)',
        body.decode(),
    )
    assert counted and float(counted.group(1)) >= cached


def test_the_admin_switch_turns_the_prompt_cache_off_live(live, orm):
    """The model's *prompt cache* switch reaches the running engine without a
    restart: the same prompt twice then takes nothing from the cache; on
    again, it does."""
    fields = {
        "model": CHAT,
        "messages": [{"role": "user", "content": "Describe a harbour crane."}],
        "max_tokens": 2,
        "temperature": 0,
    }

    def cached_on_repeat() -> int:
        live.client().chat.completions.create(**fields)
        again = live.client().chat.completions.create(**fields)
        return again.usage.prompt_tokens_details.cached_tokens

    assert cached_on_repeat() > 0
    ModelConfig.objects.filter(name=CHAT).update(prompt_cache=False)
    try:
        wait_for(lambda: cached_on_repeat() == 0, timeout=60, what="cache off")
    finally:
        ModelConfig.objects.filter(name=CHAT).update(prompt_cache=True)
    wait_for(lambda: cached_on_repeat() > 0, timeout=60, what="cache on again")


def test_chat_completion(live, orm):
    reply = live.client().chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=5,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 5
    assert reply.usage.prompt_tokens > 5
    assert reply.id.startswith("chatcmpl-")
    row = wait_for_usage(
        endpoint="chat.completions",
        key__name="main",
        status=200,
        prompt_tokens=reply.usage.prompt_tokens,
        completion_tokens=reply.usage.completion_tokens,
    )
    assert row.engine == ENGINE
    assert row.model == CHAT
    assert row.latency_ms > 0
    # Roundhouse's addition: the engine that answered and its own times.
    timings = reply.model_extra["timings"]
    assert timings["engine"] == ENGINE
    assert 0 < timings["engine_first_token_ms"] <= timings["engine_total_ms"]


def test_streamed_chat_matches_the_plain_answer(live):
    """Greedy decoding: the streamed deltas join into the plain answer; with
    include_usage the last chunk carries the usage and no choices."""
    request = {
        "model": CHAT,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 12,
        "temperature": 0,
        "seed": 7,
    }
    plain = live.client().chat.completions.create(**request)
    chunks = list(
        live.client().chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(
        chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices
    )
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    timings = finals[0].model_extra["timings"]
    assert timings["engine"] == ENGINE
    assert 0 < timings["engine_first_token_ms"] <= timings["engine_total_ms"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def http_chunks(port: int, key: str, body: dict) -> tuple[bytes, list[bytes]]:
    """POST a streamed request; the response's head and each HTTP chunk of its
    body as it came (uvicorn sends each body message as one chunk)."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Connection: close\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\n".encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            received = sock.recv(65536)
            assert received, f"the connection closed early: {data!r}"
            data += received
    head, _, rest = data.partition(b"\r\n\r\n")
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return head, chunks
        chunks.append(rest[:size])
        rest = rest[size + 2 :]


def test_a_stream_sends_chunks_due_together_in_one_write(live):
    """The role chunk leaves with the first token, and the final chunk, the usage
    and [DONE] leave together: one write each, not one per event."""
    head, chunks = http_chunks(
        live.port,
        live.keys["main"],
        {
            "model": CHAT,
            "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert head.startswith(b"HTTP/1.1 200")

    def events(chunk: bytes) -> list:
        lines = chunk.decode().split("\n\n")
        return [line.removeprefix("data: ") for line in lines if line]

    first = [json.loads(event) for event in events(chunks[0])]
    assert [e["choices"][0]["delta"].get("role") for e in first] == ["assistant", None]
    assert first[1]["choices"][0]["delta"]["content"]
    last = events(chunks[-1])
    assert last[-1] == "[DONE]"
    assert json.loads(last[-2])["usage"]["completion_tokens"] == 6
    assert json.loads(last[-3])["choices"][0]["finish_reason"] == "length"
    # Every chunk between carries one token.
    assert all(len(events(chunk)) == 1 for chunk in chunks[1:-1])


def test_text_completion_with_stop(live):
    reply = live.client().completions.create(
        model=CHAT, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=["7"]
    )
    assert reply.object == "text_completion"
    assert "7" not in reply.choices[0].text
    assert reply.usage.completion_tokens >= 1
    streamed = "".join(
        chunk.choices[0].text
        for chunk in live.client().completions.create(
            model=CHAT,
            prompt="1, 2, 3, 4,",
            max_tokens=20,
            temperature=0,
            stop=["7"],
            stream=True,
        )
    )
    assert streamed == reply.choices[0].text


def test_embeddings_float_and_base64_agree(live, orm):
    texts = ["the harbour at dawn", "a ship leaves the port", "ledger of slots"]
    as_float = live.client().embeddings.create(
        model=EMBEDDER, input=texts, encoding_format="float"
    )
    # The client asks for base64 by default and decodes it itself.
    as_base64 = live.client().embeddings.create(model=EMBEDDER, input=texts)
    rows = np.array([item.embedding for item in as_float.data])
    assert rows.shape == (3, 384)
    assert [item.index for item in as_float.data] == [0, 1, 2]
    np.testing.assert_allclose(
        np.array([item.embedding for item in as_base64.data]), rows, atol=1e-6
    )
    assert np.allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-3)
    assert as_float.usage.prompt_tokens >= len(" ".join(texts).split())
    single = live.client().embeddings.create(model=EMBEDDER, input=texts[0])
    np.testing.assert_allclose(single.data[0].embedding, rows[0], atol=1e-5)
    assert single.usage.prompt_tokens < as_float.usage.prompt_tokens
    row = wait_for_usage(
        endpoint="embeddings", status=200, prompt_tokens=single.usage.prompt_tokens
    )
    assert (row.model, row.engine, row.completion_tokens) == (EMBEDDER, ENGINE, 0)
    # Raw base64 is little-endian float32, as OpenAI sends it.
    status, _, body = live.post(
        "/v1/embeddings",
        json.dumps(
            {"model": EMBEDDER, "input": texts[0], "encoding_format": "base64"}
        ).encode(),
    )
    assert status == 200
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, rows[0], atol=1e-5)


# -- health, metrics, OpenAPI ----------------------------------------------


def test_healthz_reports_engines_without_secrets(live):
    status, _, body = live.get("/healthz")
    assert status == 200
    health = json.loads(body)
    assert health["engines"][ENGINE]["ready"] is True
    token = json.loads((live.run_dir / "engines" / f"{ENGINE}.json").read_text())
    assert token["token"] not in body.decode()


def test_metrics_count_requests_tokens_and_engines(live):
    live.client().chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    resident = f'roundhouse_model_resident{{engine="{ENGINE}",model="{CHAT}"}}'
    # The supervisor records resident models on its next poll (every second).
    wait_for(
        lambda: resident in live.get("/metrics")[2].decode(),
        timeout=30,
        what="the chat model resident in /metrics",
    )
    status, headers, body = live.get("/metrics")
    text = body.decode()
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert (
        f'roundhouse_requests_total{{endpoint="chat.completions",engine="{ENGINE}",'
        f'model="{CHAT}",status="200"}}'
    ) in text
    assert f'roundhouse_engine_up{{engine="{ENGINE}",node=""}} 1.0' in text
    assert "roundhouse_request_latency_seconds_bucket" in text
    assert "roundhouse_tokens_total" in text
    assert "roundhouse_engine_restarts_total" in text
    assert resident in text


def test_openapi_document_matches_the_schemas(live):
    from api.schemas import ENDPOINT_SCHEMAS

    status, _, body = live.get("/v1/openapi.json")
    document = json.loads(body)
    assert status == 200
    for path, schema in ENDPOINT_SCHEMAS.items():
        ref = document["paths"][path]["post"]["requestBody"]["content"][
            "application/json"
        ]["schema"]["$ref"]
        component = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert component["additionalProperties"] is False
        assert set(component["properties"]) == set(schema.model_fields)
    assert set(document["components"]["schemas"]["ChatCompletionRequest"]["required"])
    assert {"model", "messages"} <= set(
        document["components"]["schemas"]["ChatCompletionRequest"]["required"]
    )


def test_unknown_v1_path_is_an_openai_404(live):
    status, _, body = live.get("/v1/nope")
    assert status == 404
    assert json.loads(body)["error"]["code"] == "unknown_url"


def test_engine_unreachable_falls_back_to_the_next(
    live, orm, settings, tmp_path, own_gateway
):
    """The front's fallback, in-process: the snapshot says `ghost` is up and has
    the model resident (so routing picks it first), but nothing listens on its
    port. The request goes on to the real engine; the usage row names it."""
    from django.test import Client

    from api.gateway import front_gateway
    from routing.select import EngineStatus, ModelRoute, Snapshot

    engines_dir = tmp_path / "engines"
    engines_dir.mkdir()
    real = live.run_dir / "engines" / f"{ENGINE}.json"
    (engines_dir / real.name).write_text(real.read_text())
    (engines_dir / "ghost.json").write_text(
        json.dumps({"name": "ghost", "port": free_port_block(1), "token": "x"})
    )
    settings.RUN_DIR = tmp_path
    serves = frozenset({"gguf", "embedding"})
    snapshot = Snapshot(
        engines={
            "ghost": EngineStatus(
                "ghost", "cpu", serves, up=True, resident=frozenset({EMBEDDER})
            ),
            ENGINE: EngineStatus(ENGINE, "cpu", serves, up=True, order=1),
        },
        models={EMBEDDER: ModelRoute(EMBEDDER, "embedding", task="embedding")},
    )
    assert (
        front_gateway().router.choose(snapshot.models[EMBEDDER], snapshot).engine
        == "ghost"
    )
    own_gateway(lambda: snapshot)
    reply = Client().post(
        "/v1/embeddings",
        data=json.dumps({"model": EMBEDDER, "input": "fallback"}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {live.keys['fallback']}",
    )
    assert reply.status_code == 200, reply.content
    assert len(reply.json()["data"][0]["embedding"]) == 384
    wait_for_usage(key__name="fallback")
    rows = usage_rows(key__name="fallback")
    assert [(row.engine, row.status) for row in rows] == [(ENGINE, 200)]


def test_engine_killed_mid_request_is_502_then_respawned(live):
    """Runs last: the engine dies while answering; the caller gets 502, and the
    supervisor brings the engine back for the next request."""
    import threading

    outcome = {}

    def ask():
        try:
            live.client().completions.create(
                model=CHAT, prompt="A long tale:", max_tokens=400
            )
        except openai.APIStatusError as error:
            outcome["error"] = error

    engine = live.engine()
    for _ in range(5):  # a sampled tale may end within a poll: ask again
        asking = threading.Thread(target=ask)
        asking.start()
        wait_for(
            lambda asking=asking: (
                engine.state().slots_in_use == 1 or not asking.is_alive()
            ),
            what="the request running",
        )
        if asking.is_alive():
            break
    os.kill(engine.state().pid, signal.SIGKILL)
    asking.join(60)
    assert outcome["error"].status_code == 502
    assert outcome["error"].body["code"] == "engine_died"

    live.wait_engine_back()
