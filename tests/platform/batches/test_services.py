"""A worker's claim on a batch, recording lines once each, resuming a batch
whose worker is gone, and reading input lines, without a worker (the
end-to-end runs are in test_batch_api and tests/platform/test_production)."""

import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from django.utils import timezone

from api import errors
from batches import services
from batches.lines import (
    SKIP_CHUNK_BYTES,
    MalformedLine,
    Oversized,
    count_lines,
    custom_id_of,
    input_lines,
    read_line,
)
from batches.models import Batch, BatchLine
from catalog.leases import worker_identity
from tests.factories import ApiKeyFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def batch(settings, tmp_path):
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    key = ApiKeyFactory()
    stored = services.file_store(
        key=key,
        chunks=[b'{"a": 1}\n', b'{"b": 2}'],
        filename="in.jsonl",
        purpose="batch",
    )
    assert stored.path.read_bytes() == b'{"a": 1}\n{"b": 2}'
    return services.batch_create(
        key=key,
        input_file_id=stored.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )


def a_dead_owner() -> str:
    """The identity of a process of this host that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    return f"{socket.gethostname()}:{child.pid}:0:run"


def test_one_worker_holds_a_batch_until_its_lease_expires(batch):
    assert services.batch_claim(batch_id=batch.id, owner="host:1:1:a")
    assert not services.batch_claim(batch_id=batch.id, owner="host:2:2:b")
    assert services.batch_claim(batch_id=batch.id, owner="host:1:1:a")  # renewal
    Batch.objects.filter(pk=batch.id).update(
        lease_until=timezone.now() - timedelta(seconds=1)
    )
    assert services.batch_claim(batch_id=batch.id, owner="host:2:2:b")


def test_leases_are_judged_by_the_database_clock_not_a_workers(batch, monkeypatch):
    """A worker on a host whose clock runs an hour ahead neither takes a live
    lease over nor resumes its batch: leases are stamped and aged by the
    database's clock. Control: a lease that did expire by that clock is taken
    over (and counted as a crash)."""
    assert services.batch_claim(batch_id=batch.id, owner="host:1:1:a")
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(hours=1))
    assert not services.batch_claim(batch_id=batch.id, owner="other:2:2:b")
    assert services.batches_resume() == []  # held by a live worker elsewhere
    monkeypatch.undo()
    Batch.objects.filter(pk=batch.id).update(
        lease_until=timezone.now() - timedelta(seconds=1)
    )
    assert services.batch_claim(batch_id=batch.id, owner="other:2:2:b")
    assert Batch.objects.get(pk=batch.id).crashes == 1


def test_a_line_keeps_its_first_answer_and_a_fenced_worker_records_nothing(batch):
    services.batch_claim(batch_id=batch.id, owner="w:1:1:a")
    first = [(0, "a", True, {"n": 1})]
    services.batch_record(batch_id=batch.id, owner="w:1:1:a", answers=first)
    again = [(0, "a", True, {"n": 2}), (1, "b", False, {"n": 3})]
    services.batch_record(batch_id=batch.id, owner="w:1:1:a", answers=again)
    rows = dict(BatchLine.objects.values_list("index", "record"))
    assert rows == {0: {"n": 1}, 1: {"n": 3}}
    batch.refresh_from_db()
    assert (batch.completed, batch.failed) == (1, 1)
    with pytest.raises(services.LeaseLost):
        services.batch_record(
            batch_id=batch.id, owner="w:9:9:z", answers=[(1, "b", True, {"n": 4})]
        )
    assert BatchLine.objects.get(index=1).record == {"n": 3}


def test_a_batch_whose_worker_died_is_resumed_and_a_live_ones_is_not(batch):
    services.batch_claim(batch_id=batch.id, owner=worker_identity())
    assert services.batches_resume() == []  # held by this live process
    Batch.objects.filter(pk=batch.id).update(lease_owner=a_dead_owner())
    assert services.batches_resume() == [batch.id]
    batch.refresh_from_db()
    assert batch.lease_owner == "" and batch.lease_until is None


def test_finalizing_twice_writes_the_same_files(batch, settings):
    owner = "w:1:1:a"
    services.batch_claim(batch_id=batch.id, owner=owner)
    services.batch_start(batch=batch, total=2)
    services.batch_record(
        batch_id=batch.id,
        owner=owner,
        answers=[(1, "b", False, {"e": 1}), (0, "a", True, {"o": 1})],
    )
    services.batch_finalize(batch_id=batch.id, owner=owner, final="completed")
    batch.refresh_from_db()
    assert batch.status == "completed" and batch.completed_at is not None
    assert batch.output_file.path.read_text() == '{"o":1}\n'
    assert batch.error_file.path.read_text() == '{"e":1}\n'


@pytest.mark.parametrize(
    ("raw", "custom_id", "needle"),
    [
        (b"{", "", "not valid JSON"),
        (
            b'{"custom_id": "x", "method": "GET", "url": "/v1/completions", '
            b'"body": {}}',
            "x",
            "method",
        ),
        (
            b'{"custom_id": "y", "method": "POST", "url": "/v1/completions", '
            b'"body": {}, "extra": 1}',
            "y",
            "extra",
        ),
        (
            b'{"custom_id": "z", "method": "POST", "url": "/v1/embeddings", '
            b'"body": {}}',
            "z",
            "/v1/embeddings",
        ),
        (b"[" + b" " * 200 + b"]", "", "cap"),
    ],
)
def test_malformed_lines_say_why(raw, custom_id, needle):
    with pytest.raises(MalformedLine) as bad:
        read_line(raw, endpoint="/v1/completions", max_bytes=128)
    assert bad.value.custom_id == custom_id
    assert needle in bad.value.message


def test_a_good_line_is_read():
    line = read_line(
        b'{"custom_id": "q", "method": "POST", "url": "/v1/completions", '
        b'"body": {"model": "m", "prompt": "hi"}}',
        endpoint="/v1/completions",
        max_bytes=1024,
    )
    assert (line.custom_id, line.body["prompt"]) == ("q", "hi")


def test_a_lines_custom_id_is_found_whatever_else_is_wrong():
    """What an expired line's error record is filed under."""
    assert custom_id_of(b'{"custom_id": "a", "method": "GET"}') == "a"
    assert custom_id_of(b'{"custom_id": 7}') == ""
    assert custom_id_of(b"{not json") == ""


def test_the_upload_counts_lines_as_the_worker_splits_them(settings, tmp_path):
    """Lines end at LF only: a file of bare CRs is one line, a CRLF ending
    loses its CR, and the count at upload is what the worker reads (control:
    bytes.splitlines, which the worker used, splits on every CR)."""
    settings.ROUNDHOUSE_FILES_DIR = tmp_path
    data = b'{"a": 1}\r\n' + b"\r" * 100_000 + b'\n\r{"b": 2}\r'
    stored = services.file_store(
        key=ApiKeyFactory(), chunks=[data], filename="cr.jsonl", purpose="batch"
    )
    with open(stored.path, "rb") as handle:
        lines = list(input_lines(handle, max_bytes=1000))
    # The CRs' last one and the LF after it end that line (CRLF).
    assert lines == [b'{"a": 1}', Oversized(99_999), b'\r{"b": 2}\r']
    with open(stored.path, "rb") as handle:
        assert count_lines(handle) == 3
    assert len(data.splitlines()) != 3  # what the worker read before


def test_a_line_over_the_cap_is_read_past_in_bounded_memory(tmp_path):
    """An oversized line is skipped a chunk at a time: what is returned is
    its size, and the next line after it."""
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"x" * (5 * SKIP_CHUNK_BYTES + 3) + b"\r\n{}\n")
    with open(path, "rb") as handle:
        assert list(input_lines(handle, max_bytes=64)) == [
            Oversized(5 * SKIP_CHUNK_BYTES + 3),
            b"{}",
        ]


def test_a_batch_whose_runs_keep_dying_is_failed_not_resumed(batch):
    """Each resume after a run died holding the batch counts a crash; at
    MAX_CRASHES the batch fails with `batch_crashed` instead of being queued
    again (control: before, it was queued again every time). A run that
    records an answer clears the count."""
    for crashes in range(1, services.MAX_CRASHES):
        Batch.objects.filter(pk=batch.id).update(lease_owner=a_dead_owner())
        assert services.batches_resume() == [batch.id]
        batch.refresh_from_db()
        assert batch.crashes == crashes and batch.status == "validating"
    owner = worker_identity()
    services.batch_claim(batch_id=batch.id, owner=owner)
    services.batch_record(
        batch_id=batch.id, owner=owner, answers=[(0, "a", True, {"o": 1})]
    )
    assert Batch.objects.get(pk=batch.id).crashes == 0
    for _ in range(services.MAX_CRASHES):
        Batch.objects.filter(pk=batch.id).update(lease_owner=a_dead_owner())
        services.batches_resume()
    batch.refresh_from_db()
    assert batch.status == "failed", batch.status
    assert batch.errors[0]["code"] == "batch_crashed"
    assert services.batches_resume() == []


def test_a_queued_batch_is_not_queued_again_while_it_waits(batch):
    """A batch sent to the broker is not sent again by each resume while no
    worker has taken it (control: before, every resume queued every
    unclaimed batch); it is after REQUEUE_AFTER_S, or at once when a worker
    that held it is gone."""
    assert Batch.objects.get(pk=batch.id).queued_at is not None
    assert services.batches_resume() == []
    Batch.objects.filter(pk=batch.id).update(
        queued_at=timezone.now() - timedelta(seconds=services.REQUEUE_AFTER_S + 1)
    )
    assert services.batches_resume() == [batch.id]
    assert services.batches_resume() == []  # stamped again
    services.batch_claim(batch_id=batch.id, owner="w:1:1:a")
    assert Batch.objects.get(pk=batch.id).queued_at is None
    Batch.objects.filter(pk=batch.id).update(lease_owner=a_dead_owner())
    assert services.batches_resume() == [batch.id]


def test_a_batch_needs_a_key():
    """batch_create refuses a batch without a key (its lines could not be
    admitted in any budget)."""
    with pytest.raises(errors.ApiError) as refused:
        services.batch_create(
            key=None,
            input_file_id="file-x",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=None,
        )
    assert refused.value.status == 401
