"""A chat longer than the model's context through the REST API (the front's
ASGI handler and a real engine whose SmolLM2 has a 512-token context and drops
the oldest turns): the answer's header says how many messages were dropped;
what cannot fit is a 400 `context_length_exceeded` naming the counts."""

import json

import pytest
from asgiref.sync import sync_to_async

from api.sse import DROPPED_HEADER
from tests.factories import ApiKeyFactory
from tests.platform.api.chat_front import (
    CHAT,
    asgi_request,
    chat_engine,
    long_chat,
    routed_to,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = chat_engine(tmp_path_factory.mktemp("context-overflow"))
    yield engine
    engine.stop()


@pytest.fixture
def front(engine, tmp_path, settings, own_gateway):
    return routed_to(engine, tmp_path, settings, own_gateway)


async def post(app, key: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    """One chat request through the ASGI app: status, headers, whole body."""
    return await asgi_request(app, key, body=body)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_says_how_many_messages_were_dropped(front, stream):
    key = await sync_to_async(ApiKeyFactory)()
    body = {
        "model": CHAT,
        "messages": long_chat(),
        "max_tokens": 4,
        "temperature": 0,
        "stream": stream,
    }
    status, headers, answer = await post(front, key.plaintext, body)
    assert status == 200, answer[:300]
    dropped = int(headers[DROPPED_HEADER.lower()])
    assert 0 < dropped < 32 and dropped % 2 == 0
    # The control: a conversation that fits has no such header.
    body["messages"] = long_chat()[-3:]
    status, headers, _ = await post(front, key.plaintext, body)
    assert status == 200
    assert DROPPED_HEADER.lower() not in headers


async def test_what_cannot_fit_is_a_400_naming_the_counts(front):
    key = await sync_to_async(ApiKeyFactory)()
    body = {
        "model": CHAT,
        "messages": [
            {"role": "system", "content": "Rules: " + "be kind. " * 300},
            {"role": "user", "content": "Hello?"},
        ],
        "max_tokens": 4,
    }
    status, _, answer = await post(front, key.plaintext, body)
    assert status == 400
    error = json.loads(answer)["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert "context holds 512" in error["message"]
    assert "tokens" in error["message"]
