"""The Batch API end to end with the official `openai` client: a live front
and supervisor (a real engine serving SmolLM2 and MiniLM), and a real Celery
worker on the embedded broker (kombu's filesystem transport in the run dir),
as `make run` starts them, on the test database."""

import http.client
import math
from datetime import UTC, datetime

import openai
import pytest

from api.models import Usage
from batches.models import BatchLine
from tests.platform import live_platform
from tests.platform.batches.jobs import chat_line, jsonl, records, wait_batch
from tests.platform.live_platform import CHAT, EMBEDDER
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm


@pytest.fixture(scope="module")
def worker(live):
    process = live.start_worker()
    yield process


def upload(client: openai.OpenAI, data: bytes) -> str:
    return client.files.create(file=("input.jsonl", data), purpose="batch").id


def test_a_batch_answers_good_lines_and_files_the_bad_ones(live, worker, orm):
    """Five questions and four bad lines: the five are answered (each in a
    live request's shape), the four are in the error file, each with why."""
    client = live.client()
    good = [chat_line(f"q{n}", f"Name a colour, {n}.", model=CHAT) for n in range(5)]
    bad = [
        b"{not json",
        chat_line("nobody", "Hi", model="no-such-model"),
        {**chat_line("elsewhere", "Hi", model=CHAT), "url": "/v1/embeddings"},
        chat_line("streamed", "Hi", model=CHAT, stream=True),
    ]
    lines = [good[0], bad[0], *good[1:3], *bad[1:], *good[3:]]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "colours"},
    )
    assert batch.status == "validating"
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (9, 5, 4)
    assert batch.metadata == {"job": "colours"}

    output = records(client, batch.output_file_id)
    assert [r["custom_id"] for r in output] == [f"q{n}" for n in range(5)]
    for record in output:
        answer = record["response"]
        assert answer["status_code"] == 200
        # A live request's body, as the official client reads one.
        parsed = openai.types.chat.ChatCompletion.model_validate(answer["body"])
        assert parsed.model == CHAT and parsed.choices[0].message.content
        assert 0 < parsed.usage.completion_tokens <= 8
        assert answer["request_id"] == parsed.id

    errors = {r["custom_id"]: r for r in records(client, batch.error_file_id)}
    assert set(errors) == {"", "nobody", "elsewhere", "streamed"}
    assert errors[""]["error"]["code"] == "invalid_request"
    assert "not valid JSON" in errors[""]["error"]["message"]
    assert errors["nobody"]["response"]["status_code"] == 404
    assert "/v1/embeddings" in errors["elsewhere"]["error"]["message"]
    assert errors["streamed"]["response"]["status_code"] == 400
    # The key pays for its lines: a usage row per line sent to an engine.
    since = datetime.fromtimestamp(batch.created_at, UTC)
    assert wait_for(
        lambda: (
            Usage.objects.filter(
                key__name="main", model=CHAT, status=200, created_at__gte=since
            ).count()
            == 5
        ),
        timeout=30,
        what="usage rows of the batch's lines",
    )
    listed = [b.id for b in client.batches.list(limit=100)]
    assert batch.id in listed


def test_an_embeddings_batch_gives_the_live_vectors(live, worker):
    client = live.client()
    texts = ["a red boat", "a blue train", "a green field"]
    lines = [
        {
            "custom_id": f"e{n}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBEDDER, "input": text},
        }
        for n, text in enumerate(texts)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    batch = wait_batch(client, batch.id)
    assert batch.request_counts.completed == 3, batch
    output = records(client, batch.output_file_id)
    vector = output[1]["response"]["body"]["data"][0]["embedding"]
    alone = client.embeddings.create(model=EMBEDDER, input=texts[1]).data[0].embedding
    assert len(vector) == 384
    assert math.dist(vector, alone) < 1e-4


def test_a_cancelled_batch_stops_and_keeps_what_was_answered(live, worker, orm):
    client = live.client()
    lines = [
        chat_line(f"long{n}", f"Tell a long story {n}.", model=CHAT, max_tokens=64)
        for n in range(30)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled", batch
    answered = batch.request_counts.completed
    assert 1 <= answered < 30
    assert len(records(client, batch.output_file_id)) == answered
    assert BatchLine.objects.filter(batch_id=batch.id).count() == answered


def test_files_and_batches_refuse_what_they_cannot_take(live):
    client = live.client()
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.files.create(file=("x.jsonl", b""), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="50000"):
        client.files.create(file=("x.jsonl", b"{}\n" * 50_001), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope",
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    file_id = upload(client, jsonl([chat_line("a", "Hi", model=CHAT)]))
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/models", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="24h"):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="1h",
        )
    # Another owner's file is not there for this key.
    with pytest.raises(openai.NotFoundError):
        live.client("fallback").files.retrieve(file_id)
    assert client.files.retrieve(file_id).bytes > 0
    assert client.files.content(file_id).text.startswith('{"custom_id": "a"')
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_an_upload_over_the_cap_is_refused_before_it_is_read(live):
    """The declared size alone gets the 413: the body is never sent."""
    connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    connection.putrequest("POST", "/v1/files")
    connection.putheader("Authorization", f"Bearer {live.keys['main']}")
    connection.putheader("Content-Type", "multipart/form-data; boundary=x")
    connection.putheader("Content-Length", str(10 * 1024**3))
    connection.endheaders()
    reply = connection.getresponse()
    assert reply.status == 413
    connection.close()
