"""The Batch API's limits end to end: a live front and supervisor (a real
engine serving SmolLM2 and MiniLM) and a real Celery worker, as in
test_batch_api, with a small byte cap per line, a short retry time and a
small storage quota. Each test makes its own keys (their limits are what it
is about)."""

import http.client
from datetime import UTC, datetime, timedelta

import openai
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from api.models import ApiKey, Usage
from batches.models import Batch
from tests.factories import ApiKeyFactory
from tests.platform import live_platform
from tests.platform.batches.jobs import chat_line, jsonl, records, wait_batch
from tests.platform.live_platform import CHAT, EMBEDDER, UNSERVED
from tests.waiting import wait_for

MIB = 1024 * 1024
QUOTA = 8 * MIB

database = live_platform.database
models_dir_path = live_platform.models_dir_path
orm = live_platform.orm


@pytest.fixture(scope="module")
def live(database, django_db_blocker, tmp_path_factory, models_dir_path):
    env = {
        "ROUNDHOUSE_MAX_REQUEST_BYTES": str(MIB),
        "ROUNDHOUSE_BATCH_RETRY_S": "3",
        "ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES": str(QUOTA),
    }
    tmp = tmp_path_factory.mktemp("live-batch-limits")
    with live_platform.start_live(
        django_db_blocker, tmp, models_dir_path, env=env
    ) as platform:
        yield platform


@pytest.fixture(scope="module")
def worker(live):
    return live.start_worker()


def a_key(**limits) -> ApiKey:
    """A new key with these limits (its secret in `plaintext`)."""
    return ApiKeyFactory(**limits)


def client_of(live, key) -> openai.OpenAI:
    return live.client(key.plaintext)


def upload(client: openai.OpenAI, data: bytes) -> str:
    return client.files.create(file=("input.jsonl", data), purpose="batch").id


def create(client: openai.OpenAI, data: bytes, endpoint="/v1/chat/completions"):
    return client.batches.create(
        input_file_id=upload(client, data),
        endpoint=endpoint,
        completion_window="24h",
    )


def usage_of(key, **filters) -> list[Usage]:
    return list(Usage.objects.filter(key=key, **filters).order_by("created_at"))


def long_lines(count: int) -> bytes:
    return jsonl(
        [
            chat_line(f"long{n}", f"Tell a long story {n}.", model=CHAT, max_tokens=64)
            for n in range(count)
        ]
    )


def every_line_once(client: openai.OpenAI, batch, total: int) -> list[dict]:
    """The error file's records, once the output and error files hold every
    line exactly once."""
    output = records(client, batch.output_file_id)
    failed = records(client, batch.error_file_id)
    ids = [r["custom_id"] for r in output + failed]
    assert sorted(ids) == sorted(f"long{n}" for n in range(total))
    assert (batch.request_counts.completed, batch.request_counts.failed) == (
        len(output),
        len(failed),
    )
    return failed


def test_a_file_of_bare_crs_has_the_lines_its_upload_counted(live, worker, orm):
    """Lines end at LF only: a file holding megabytes of bare CRs is read a
    line at a time by the worker, with bounded memory; the CR line over the
    byte cap is one error line, the others are answered, and the batch has
    the lines its upload counted (control: the worker's splitlines made
    millions of lines of it; it held them all in memory)."""
    key = a_key()
    client = client_of(live, key)
    data = (
        jsonl([chat_line("first", "Hi", model=CHAT)])
        + b"\r" * (3 * MIB)
        + b"\n\r\r"
        + jsonl([chat_line("crs", "Hi", model=CHAT)]).rstrip(b"\n")
        + b"\r\r\n"
        + jsonl([chat_line("crlf", "Hi", model=CHAT)]).rstrip(b"\n")
        + b"\r\n"
    )
    assert len(data.splitlines()) > 3 * MIB  # how the worker split it before
    batch = wait_batch(client, create(client, data).id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (4, 3, 1)
    output = records(client, batch.output_file_id)
    assert [r["custom_id"] for r in output] == ["first", "crs", "crlf"]
    (too_long,) = records(client, batch.error_file_id)
    assert too_long["error"]["code"] == "invalid_request"
    assert f"the cap is {MIB}" in too_long["error"]["message"]


def test_batch_lines_are_admitted_with_the_keys_concurrency(live, worker, orm):
    """A line is admitted in its key's batch budget: with max_concurrent 1, a
    line asking for two choices is refused as too heavy (400), the others
    are answered one at a time (control: before, batch lines were never
    admitted, and the two choices were answered)."""
    key = a_key(max_concurrent=1)
    client = client_of(live, key)
    lines = [chat_line(f"q{n}", f"Say {n}.", model=CHAT) for n in range(3)]
    lines.append(chat_line("two", "Say two.", model=CHAT, n=2))
    batch = wait_batch(client, create(client, jsonl(lines)).id)
    assert batch.status == "completed", batch
    (heavy,) = records(client, batch.error_file_id)
    assert heavy["custom_id"] == "two"
    assert heavy["response"]["status_code"] == 400
    assert heavy["response"]["body"]["error"]["code"] == "concurrency_limit_exceeded"
    assert len(records(client, batch.output_file_id)) == 3
    # One usage row per answered line: no row for a refusal while waiting.
    wait_for(lambda: len(usage_of(key)) >= 3, timeout=30, what="usage rows")
    assert [row.status for row in usage_of(key)] == [200, 200, 200]


def test_a_keys_rate_limit_paces_its_batch(live, worker, orm):
    """With rpm_limit 2, a batch's third line waits for the next minute (its
    Retry-After) instead of being sent or failed, and writes no usage row
    while it waits (control: before, all three were sent at once). The
    upload and the creation count in the key's live budget, not this one."""
    key = a_key(rpm_limit=2)
    client = client_of(live, key)
    lines = [chat_line(f"r{n}", f"Say {n}.", model=CHAT) for n in range(3)]
    batch = wait_batch(client, create(client, jsonl(lines)).id, timeout=200)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 3
    rows = wait_for(
        lambda: (rows := usage_of(key)) and len(rows) >= 3 and rows,
        timeout=30,
        what="usage rows",
    )
    assert [row.status for row in rows] == [200, 200, 200]
    started = datetime.fromtimestamp(batch.in_progress_at, UTC)
    next_minute = started.replace(second=0, microsecond=0) + timedelta(minutes=1)
    assert rows[2].created_at >= next_minute


def test_creating_files_and_batches_counts_in_the_keys_rate(live, orm):
    """Uploads and batch creations are admitted in the key's live budget:
    with rpm_limit 1, quick uploads after the first get 429 (control:
    before, none was ever refused)."""
    key = a_key(rpm_limit=1)
    client = client_of(live, key)
    refused = []
    for _ in range(3):
        try:
            upload(client, jsonl([chat_line("a", "Hi", model=CHAT)]))
        except openai.RateLimitError as error:
            refused.append(error)
    assert refused and "Rate limit" in refused[0].message


def test_a_line_for_a_model_the_key_may_not_use_is_an_error(live, worker, orm):
    """A key limited to the embedder gets a 404 error line for a chat line,
    and nothing answered: the key's model list applies to batch lines."""
    key = ApiKeyFactory(allowed_models=[live_embedder()])
    client = client_of(live, key)
    batch = wait_batch(
        client, create(client, jsonl([chat_line("c", "Hi", model=CHAT)])).id
    )
    assert batch.request_counts.completed == 0 and batch.output_file_id is None
    (error,) = records(client, batch.error_file_id)
    assert error["response"]["status_code"] == 404


def live_embedder():
    from catalog.models import ModelConfig

    return ModelConfig.objects.get(name=EMBEDDER)


def test_revoking_a_key_stops_its_batches(live, worker, orm):
    """A batch whose key is revoked mid-run stops at its next record: it
    fails with `key_revoked`, and every line is in exactly one file, those
    not answered in the error file with that code (control: before, the
    batch ran to its end on the revoked key)."""
    owner = get_user_model().objects.create(username="revoked-owner")
    key, reader = ApiKeyFactory(owner=owner), ApiKeyFactory(owner=owner)
    batch = create(client_of(live, key), long_lines(30))
    client = client_of(live, reader)  # the same owner's: it sees the batch
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    key.revoked_at = timezone.now()
    key.save()
    batch = wait_batch(client, batch.id)
    assert batch.status == "failed", batch
    assert batch.errors.data[0].code == "key_revoked"
    failed = every_line_once(client, batch, 30)
    assert {r["error"]["code"] for r in failed} == {"key_revoked"}


def test_an_expired_batch_files_the_lines_in_flight(live, worker, orm):
    """A batch that expires while lines are in flight files those lines too:
    output and error lines add up to the total, each line exactly once
    (control: before, the lines in flight were in neither file)."""
    key = a_key()
    client = client_of(live, key)
    batch = create(client, long_lines(30))
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now())
    batch = wait_batch(client, batch.id)
    assert batch.status == "expired", batch
    assert batch.request_counts.total == 30
    failed = every_line_once(client, batch, 30)
    assert failed and {r["error"]["code"] for r in failed} == {"batch_expired"}


def test_a_line_tried_again_has_one_usage_row(live, worker, orm):
    """A line no engine can serve is tried again until the retry time is
    over, then filed as a 503; it has one usage row, not one per try
    (control: before, every try wrote one)."""
    key = a_key()
    client = client_of(live, key)
    lines = [chat_line(f"u{n}", "Hi", model=UNSERVED) for n in range(2)]
    batch = wait_batch(client, create(client, jsonl(lines)).id, timeout=60)
    assert batch.request_counts.failed == 2, batch
    assert {
        r["response"]["status_code"] for r in records(client, batch.error_file_id)
    } == {503}
    rows = wait_for(
        lambda: (rows := usage_of(key)) and len(rows) >= 2 and rows,
        timeout=30,
        what="both lines' usage rows",
    )
    assert [(row.model, row.status) for row in rows] == [(UNSERVED, 503)] * 2


def test_lines_cancelled_in_flight_have_a_usage_row(live, worker, orm):
    """A cancelled batch's lines in flight end in a usage row each (499,
    `batch_cancelled`), beside one per answered line (control: before,
    cancelled lines had none)."""
    key = a_key()
    client = client_of(live, key)
    batch = create(client, long_lines(30))
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    client.batches.cancel(batch.id)
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled", batch
    answered = batch.request_counts.completed
    assert answered < 30
    rows = wait_for(
        lambda: (
            (rows := usage_of(key))
            and any(row.status == 499 for row in rows)
            and len([r for r in rows if r.status == 200]) >= answered
            and rows
        ),
        timeout=30,
        what="usage rows of the answered and the cancelled lines",
    )
    assert len([r for r in rows if r.status == 200]) == answered
    assert {r.error_code for r in rows if r.status != 200} == {"batch_cancelled"}


def test_an_upload_over_the_quota_is_refused_and_deleting_makes_room(live, orm):
    """The owner's quota: a declared size over it is refused before the body
    is read (413 when the file alone is over it); a file that does not fit
    beside the others gets 429 quota_exceeded, not to be retried; deleting
    a file makes room (control: before, nothing was refused)."""
    key = a_key()
    connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    connection.putrequest("POST", "/v1/files")
    connection.putheader("Authorization", f"Bearer {key.plaintext}")
    connection.putheader("Content-Type", "multipart/form-data; boundary=x")
    connection.putheader("Content-Length", str(QUOTA + MIB))
    connection.endheaders()
    reply = connection.getresponse()
    assert reply.status == 413
    assert b"quota_exceeded" in reply.read()
    connection.close()

    client = client_of(live, key)
    line = jsonl([chat_line("pad", "x" * (3 * MIB), model=CHAT)])
    first = upload(client, line)
    upload(client, line)
    with pytest.raises(openai.RateLimitError) as over:
        upload(client, line)
    assert over.value.code == "quota_exceeded"
    assert "Delete files" in over.value.message
    assert over.value.response.headers["x-should-retry"] == "false"
    client.files.delete(first)
    upload(client, line)
