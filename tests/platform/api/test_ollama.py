"""Ollama's API (/api/...) end to end, as the official `ollama` client uses
it: chat and generate (streamed and whole, JSON and JSON-schema formats,
options), embeddings, the model listings (tags, show, ps), version, the
refusals in Ollama's shape, a hang-up mid-stream, the usage rows under the
`ollama.*` endpoints, and the loopback key for tools that cannot send one. A
live front and `manage.py supervise` running a real engine (SmolLM2 and
MiniLM), started once for the module (the loopback tests start a second
front on it)."""

import json
import urllib.request

import httpx
import ollama
import pytest

from api.models import ApiKey
from tests.platform import live_platform
from tests.platform.api.chat_front import WEATHER_TOOL
from tests.platform.live_platform import (
    CHAT,
    EMBEDDER,
    ENGINE,
    wait_for_usage,
)
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm

HELLO = [{"role": "user", "content": "Say hello."}]
ASK_JSON = 'Give JSON with keys "name" and "age" for Alice, who is 30.'
# MiniLM's vectors.
MINILM_DIMS = 384


def client(live, key: str = "main") -> ollama.Client:
    token = live.keys.get(key, key)
    return ollama.Client(
        host=live.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=120
    )


def raw_post(base_url: str, path: str, body: dict, headers=None) -> httpx.Response:
    return httpx.post(base_url + path, json=body, headers=headers or {}, timeout=120)


# -- generation -----------------------------------------------------------------------


def test_chat_streams_ndjson_by_default_and_ends_with_the_counts(live):
    """A body without `stream` is streamed, one JSON object per line, as
    Ollama does: text pieces, then one `done` object with why it ended and
    the counts and times in nanoseconds."""
    response = raw_post(
        live.base_url,
        "/api/chat",
        {"model": CHAT, "messages": HELLO, "options": {"num_predict": 8}},
        {"Authorization": f"Bearer {live.keys['main']}"},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert response.headers["X-Roundhouse-Engine"] == ENGINE
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert len(lines) >= 2
    assert all(line["done"] is False for line in lines[:-1])
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] in ("stop", "length")
    for name in (
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    ):
        assert isinstance(last[name], int), name
    assert last["prompt_eval_count"] > 0 and 0 < last["eval_count"] <= 8
    text = "".join(line["message"]["content"] for line in lines)
    assert text.strip()


def test_chat_with_the_client_streamed_and_whole(live):
    """The client's streamed chat gives pieces and a last `done` chunk; its
    whole chat one message, with the same final fields."""
    pieces = list(
        client(live).chat(
            model=CHAT, messages=HELLO, stream=True, options={"num_predict": 8}
        )
    )
    assert pieces[-1].done and pieces[-1].eval_count > 0
    assert "".join(p.message.content or "" for p in pieces).strip()
    whole = client(live).chat(model=CHAT, messages=HELLO, options={"num_predict": 8})
    assert whole.done and whole.message.role == "assistant"
    assert whole.message.content.strip()
    assert whole.prompt_eval_count > 0 and whole.total_duration > 0


def test_generate_answers_the_prompt_in_the_models_template(live):
    """/api/generate: a response, whole or streamed; with `raw` the prompt is
    continued as it is."""
    whole = client(live).generate(
        model=CHAT, prompt="What is 2+2?", options={"num_predict": 8}
    )
    assert whole.done and whole.response.strip() and whole.eval_count > 0
    streamed = list(
        client(live).generate(
            model=CHAT, prompt="Hi", stream=True, options={"num_predict": 5}
        )
    )
    assert streamed[-1].done and streamed[-1].done_reason in ("stop", "length")
    raw = client(live).generate(
        model=CHAT, prompt="One, two, three,", raw=True, options={"num_predict": 4}
    )
    assert raw.done and raw.eval_count > 0


def test_num_predict_limits_the_answer(live):
    """options.num_predict is the answer's token limit: 3 tokens of a long
    essay end at 3 with `length`; the control, 12, goes past 3."""
    essay = [{"role": "user", "content": "Write a very long essay about trains."}]
    short = client(live).chat(model=CHAT, messages=essay, options={"num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    longer = client(live).chat(model=CHAT, messages=essay, options={"num_predict": 12})
    assert longer.eval_count > 3


def test_json_format_gives_parseable_json(live):
    """format="json" holds the answer to JSON."""
    answer = client(live).chat(
        model=CHAT,
        messages=[{"role": "user", "content": ASK_JSON}],
        format="json",
        options={"temperature": 0, "num_predict": 300},
    )
    assert answer.done_reason == "stop"
    json.loads(answer.message.content)


def test_a_json_schema_format_gives_an_object_of_that_schema(live):
    """A JSON schema as `format` holds the answer to that schema."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    answer = client(live).generate(
        model=CHAT,
        prompt="Name a city in France.",
        format=schema,
        options={"temperature": 0, "num_predict": 60},
    )
    parsed = json.loads(answer.response)
    assert set(parsed) == {"city"} and isinstance(parsed["city"], str)


def test_a_tool_conversation_is_taken(live):
    """Earlier tool calls (arguments an object) and a tool's answer (named
    by the tool, as Ollama's messages are) are taken with tools offered."""
    tool = WEATHER_TOOL
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C."},
    ]
    answer = client(live).chat(
        model=CHAT, messages=messages, tools=[tool], options={"num_predict": 16}
    )
    assert answer.done


def test_images_are_refused_clearly(live):
    """No model here reads images: a 400 in Ollama's shape, naming them."""
    with pytest.raises(ollama.ResponseError) as error:
        client(live).chat(
            model=CHAT,
            messages=[{"role": "user", "content": "What is this?", "images": [b"x"]}],
        )
    assert error.value.status_code == 400
    assert "images" in error.value.error


# -- embeddings -----------------------------------------------------------------------


def test_embed_two_inputs_and_the_older_embeddings(live):
    """/api/embed: one MiniLM vector per input; /api/embeddings: the one
    prompt's."""
    answer = client(live).embed(model=EMBEDDER, input=["one", "two"])
    assert len(answer.embeddings) == 2
    assert all(len(vector) == MINILM_DIMS for vector in answer.embeddings)
    assert answer.embeddings[0] != answer.embeddings[1]
    older = client(live).embeddings(model=EMBEDDER, prompt="one")
    assert len(older.embedding) == MINILM_DIMS


# -- listings -------------------------------------------------------------------------


def test_tags_list_what_the_key_may_use(live):
    """The main key sees the chat model and the embedder, in Ollama's shape;
    a key allowed only the embedder sees only it (the control)."""
    listed = {m.model: m for m in client(live).list().models}
    assert {CHAT, EMBEDDER} <= set(listed)
    chat = listed[CHAT]
    assert chat.details.format == "gguf" and chat.details.family == "llama"
    assert chat.details.quantization_level == "Q4_1"
    assert chat.size > 0 and chat.digest and chat.modified_at
    restricted = {m.model for m in client(live, "embed-only").list().models}
    assert restricted == {EMBEDDER}


def test_show_tells_the_template_details_and_context(live):
    """/api/show: the chat template, details, model_info with the context
    length the model was trained for (its GGUF header's), and the context it
    is served with as its num_ctx parameter; 404 for a key that may not use
    it."""
    shown = client(live).show(CHAT)
    assert shown.template and "completion" in shown.capabilities
    assert shown.details.format == "gguf"
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert "num_ctx 1024" in shown.parameters.splitlines()
    with pytest.raises(ollama.ResponseError) as error:
        client(live, "embed-only").show(CHAT)
    assert error.value.status_code == 404


def test_ps_lists_the_resident_model_and_its_engine(live):
    """After a chat, /api/ps lists the chat model on the engine that holds
    it, with its memory and expiry (once the supervisor has recorded it)."""
    client(live).chat(model=CHAT, messages=HELLO, options={"num_predict": 2})

    def resident():
        found = [m for m in client(live).ps().models if m.model == CHAT]
        return found[0] if found else None

    running = wait_for(resident, timeout=60, what="the chat model in /api/ps")
    assert running.size > 0 and running.expires_at is not None
    raw = httpx.get(
        live.base_url + "/api/ps",
        headers={"Authorization": f"Bearer {live.keys['main']}"},
    ).json()
    entry = next(m for m in raw["models"] if m["model"] == CHAT)
    assert entry["engine"] == ENGINE


def test_version(live):
    """/api/version answers, without a key as Ollama does."""
    with urllib.request.urlopen(live.base_url + "/api/version") as reply:
        assert json.loads(reply.read())["version"]


# -- refusals -------------------------------------------------------------------------


def test_a_bad_key_is_refused(live):
    """An unknown key: 401 with Ollama's `{"error"}`."""
    with pytest.raises(ollama.ResponseError) as error:
        client(live, "rh-not-a-key").chat(model=CHAT, messages=HELLO)
    assert error.value.status_code == 401
    response = raw_post(live.base_url, "/api/tags", {})
    assert response.status_code in (401, 405)


def test_an_unknown_model_is_not_found_in_ollamas_shape(live):
    """An unknown model: 404 `{"error": "..."}` (the body a JSON object with
    one key), as the client reads it."""
    with pytest.raises(ollama.ResponseError) as error:
        client(live).chat(model="no-such-model", messages=HELLO)
    assert error.value.status_code == 404
    assert "no-such-model" in error.value.error
    response = raw_post(
        live.base_url,
        "/api/generate",
        {"model": "no-such-model", "prompt": "hi"},
        {"Authorization": f"Bearer {live.keys['main']}"},
    )
    assert response.status_code == 404
    assert set(response.json()) == {"error"}


def test_hanging_up_mid_stream_frees_the_engine_slot(live, orm):
    """The client hangs up after a few lines of a long answer: the engine
    cancels it (its slot is free long before 400 tokens could be made), and
    the usage row says the client went away."""
    engine = live.engine()
    stream = client(live).chat(
        model=CHAT,
        messages=[{"role": "user", "content": "Write a very long essay."}],
        stream=True,
        options={"num_predict": 400},
    )
    for _ in range(3):
        next(stream)
    assert engine.state().slots_in_use == 1
    stream.close()
    wait_for(
        lambda: engine.state().slots_in_use == 0, timeout=10, what="the slot freed"
    )
    row = wait_for_usage(endpoint="ollama.chat", status=499)
    assert row.error_code == "client_closed" and row.engine == ENGINE


def test_usage_rows_name_the_ollama_endpoints(live, orm):
    """Chat, generate and embed calls are recorded under ollama.chat,
    ollama.generate and ollama.embed, with their tokens."""
    client(live).chat(model=CHAT, messages=HELLO, options={"num_predict": 2})
    client(live).generate(model=CHAT, prompt="Hi", options={"num_predict": 2})
    client(live).embed(model=EMBEDDER, input="one")
    for endpoint, model in (
        ("ollama.chat", CHAT),
        ("ollama.generate", CHAT),
        ("ollama.embed", EMBEDDER),
    ):
        row = wait_for_usage(endpoint=endpoint, status=200)
        assert row.model == model and row.prompt_tokens > 0
        assert row.key.name == "main"


# -- the loopback key -----------------------------------------------------------------


def test_no_key_is_refused_by_default(live):
    """Off by default: a call with no key from 127.0.0.1 is refused."""
    response = raw_post(live.base_url, "/api/chat", {"model": CHAT, "messages": HELLO})
    assert response.status_code == 401
    assert "API key" in response.json()["error"]


def test_the_loopback_key_serves_keyless_calls_as_that_key(live, orm):
    """With ROUNDHOUSE_OLLAMA_LOOPBACK_KEY naming the embed-only key, a
    front takes keyless calls from 127.0.0.1 as that key: its models (the
    embedder, not the chat model: the control) and its usage rows; a
    forwarded call (a proxy on this host) still needs a key."""
    prefix = ApiKey.objects.get(name="embed-only").prefix
    env = live.env
    live.env = {**env, "ROUNDHOUSE_OLLAMA_LOOPBACK_KEY": prefix}
    try:
        port = live.start_front("front-loopback")
    finally:
        live.env = env
    base = f"http://127.0.0.1:{port}"
    keyless = ollama.Client(host=base, timeout=120)
    assert {m.model for m in keyless.list().models} == {EMBEDDER}
    assert len(keyless.embed(model=EMBEDDER, input="one").embeddings) == 1
    with pytest.raises(ollama.ResponseError) as error:
        keyless.chat(model=CHAT, messages=HELLO)
    assert error.value.status_code == 404
    row = wait_for_usage(endpoint="ollama.embed", key__name="embed-only")
    assert row.status == 200
    forwarded = httpx.get(
        base + "/api/tags", headers={"X-Forwarded-For": "203.0.113.9"}
    )
    assert forwarded.status_code == 401
