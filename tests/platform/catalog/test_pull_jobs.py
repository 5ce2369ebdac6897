"""Pulls as background jobs (catalog/pull_jobs.py) against the local hub
(tests/hub.py), found through HF_ENDPOINT as a mirror would be: a pull planned
before a byte, run with its progress on its row, cancelled mid-file, shown
stalled while the Hub sends nothing, continued after a Hub that stalls, and
resumed by the next worker after one is SIGKILLed mid-file, fetching only the
rest."""

import hashlib
import os
import signal
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db.models.functions import Now
from django.utils import timezone
from huggingface_hub import constants as hf_constants

from catalog.hub import HubError
from catalog.leases import worker_identity
from catalog.models import ModelConfig, ModelPull, PullStatus
from catalog.pull import PARTIAL, STAGING
from catalog.pull_jobs import pull_cancel, pull_run, pull_start, pulls_resume
from catalog.pull_progress import (
    STALLED_AFTER_S,
    progress_text,
    pull_progress,
    pulls_with_db_now,
)
from tests.hub import LocalHub
from tests.platform.catalog.conftest import start_worker, stop_worker
from tests.waiting import wait_for

REPO = "org/SmolLM2-135M-GGUF"
FILE = "smol.Q4_1.gguf"
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A vision projector's stand-in: pulled beside the model, never read here.
PROJECTOR = b"GGUF" + hashlib.sha256(b"projector").digest() * (1 << 16)


@pytest.fixture
def hub(monkeypatch, settings, tmp_path):
    smol = Path(settings.MODELS_DIR) / SMOL
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.setenv("ROUNDHOUSE_MODELS_DIR", str(settings.MODELS_DIR))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub(
        {REPO: {FILE: smol, "mmproj-smol-f16.gguf": PROJECTOR, "README.md": b"hi\n"}}
    ) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


def partial() -> Path:
    return (
        Path(settings.MODELS_DIR)
        / STAGING
        / "org--SmolLM2-135M-GGUF"
        / (FILE + PARTIAL)
    )


def in_thread(pull_id: int) -> tuple[threading.Thread, list]:
    ended: list = []
    thread = threading.Thread(target=lambda: ended.append(pull_run(pull_id)))
    thread.start()
    return thread, ended


@pytest.mark.django_db(transaction=True)
def test_a_pull_runs_to_a_model_with_its_projector_and_progress(hub):
    pull = pull_start(source=f"hf:{REPO}:Q4_1")
    assert (pull.status, pull.name) == (PullStatus.QUEUED, "smollm2-135m:q4_1")
    assert pull.plan["projector"] == "mmproj-smol-f16.gguf"
    assert pull.size_bytes == hub.blob(REPO, FILE).size + len(PROJECTOR)
    # Planned from the header alone: a few MiB of the file, not its weights.
    assert hub.bytes_served(REPO, FILE) < 4 << 20
    assert pull_run(pull.pk) == PullStatus.DONE
    pull.refresh_from_db()
    assert (pull.done_bytes, pull.left_s) == (pull.size_bytes, 0.0)
    assert pull.rate_bps > 0 and pull.finished_at is not None
    model = ModelConfig.objects.get(name="smollm2-135m:q4_1")
    assert pull.model == model
    assert (model.format, model.task) == ("gguf", "chat")
    assert model.path == f"org--SmolLM2-135M-GGUF/{FILE}"
    assert model.projector == "org--SmolLM2-135M-GGUF/mmproj-smol-f16.gguf"
    assert (Path(settings.MODELS_DIR) / model.projector).is_file()


@pytest.mark.django_db(transaction=True)
def test_a_name_taken_by_a_pull_under_way_is_refused(hub):
    """Control: once the first pull ended, the name is free for another."""
    first = pull_start(source=f"hf:{REPO}:Q4_1", name="smol")
    with pytest.raises(HubError, match="a pull of a model named smol is under way"):
        pull_start(source=f"hf:{REPO}:Q4_1", name="smol")
    pull_cancel(pull=first)
    assert pull_start(source=f"hf:{REPO}:Q4_1", name="smol").status == "queued"


@pytest.mark.django_db(transaction=True)
def test_a_pull_cancelled_mid_file_stops_and_leaves_nothing(hub):
    """Held mid-file by the hub, the pull is cancelled: it stops at its next
    progress write, its partial file removed, no model added."""
    stall = hub.stall(REPO, FILE)
    pull = pull_start(source=f"hf:{REPO}:Q4_1", name="cancelled")
    thread, ended = in_thread(pull.pk)
    assert stall.reached.wait(timeout=60), "the download never reached the stall"
    wait_for(
        lambda: ModelPull.objects.get(pk=pull.pk).done_bytes > 0,
        what="progress written while the hub held the file",
    )
    assert pull_cancel(pull=pull).cancel_requested
    stall.release.set()
    thread.join(timeout=120)
    assert ended == [PullStatus.CANCELLED]
    pull.refresh_from_db()
    assert (pull.status, pull.message) == ("cancelled", "cancelled")
    assert not partial().exists()
    assert not ModelConfig.objects.filter(name="cancelled").exists()


def progress_now(pull_id: int) -> dict:
    """The pull's progress as its page reads it, by the database's clock."""
    return pull_progress(pulls_with_db_now().get(pk=pull_id))


@pytest.mark.django_db(transaction=True)
def test_a_pull_the_hub_holds_reads_stalled_then_moving_again(hub, monkeypatch):
    """Held mid-file by the hub (its client's read deadline far off): once no
    bytes came for STALLED_AFTER_S by the database's clock, its progress says
    so, its rate nothing and its time left unknown. Released, bytes come and
    it reads as moving (control: the same reading as before the stall), then
    stalls again at a second hold, and ends done."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 300)
    first = hub.stall(REPO, FILE)
    pull = pull_start(source=f"hf:{REPO}:{FILE}", name="quiet")
    thread, ended = in_thread(pull.pk)
    second = None
    try:
        assert first.reached.wait(timeout=60), "the download never reached the stall"
        stalled = wait_for(
            lambda: (now := progress_now(pull.pk))["stalled_s"] is not None and now,
            what="the pull read as stalled while the hub held it",
        )
        assert stalled["status"] == PullStatus.RUNNING
        assert stalled["stalled_s"] >= STALLED_AFTER_S
        assert (stalled["rate"], stalled["left"]) == ("—", "—")
        assert f"no bytes for {stalled['stalled_s']} s" in stalled["text"]
        assert "MiB/s" not in stalled["text"]
        held_at = ModelPull.objects.get(pk=pull.pk).done_bytes

        second = hub.stall(REPO, FILE, fraction=0.8)
        first.release.set()
        moving = wait_for(
            lambda: (
                (now := progress_now(pull.pk))["done_bytes"] > held_at
                and now["stalled_s"] is None
                and now
            ),
            what="the pull read as moving once bytes came again",
        )
        assert moving["rate"].endswith("/s") and "left" in moving["text"]
        assert "no bytes" not in moving["text"]
        assert second.reached.wait(timeout=60), "never reached the second stall"
        wait_for(
            lambda: progress_now(pull.pk)["stalled_s"] is not None,
            what="the pull read as stalled again at the second hold",
        )
    finally:
        first.release.set()
        if second is not None:
            second.release.set()
        thread.join(timeout=120)
    assert ended == [PullStatus.DONE]
    done = progress_now(pull.pk)
    assert done["stalled_s"] is None and done["text"].startswith("done: ")


@pytest.mark.django_db(transaction=True)
def test_the_bytes_that_came_last_before_a_stall_are_on_the_row(hub, monkeypatch):
    """The hub holds the file a few of the client's chunks in, which come in
    well under PROGRESS_EVERY_S: while it holds it, the row comes to say every
    byte the client wrote to disk, not just the first chunk's (a write
    throttle with no write after it left the page behind for the whole stall,
    and a test waiting on the page for the bytes to pass the stall never saw
    them). The hub releases it and the pull ends done."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 300)
    stall = hub.stall(REPO, FILE, fraction=0.3)
    pull = pull_start(source=f"hf:{REPO}:{FILE}", name="held")
    thread, ended = in_thread(pull.pk)
    try:
        assert stall.reached.wait(timeout=60), "the download never reached the stall"
        wait_for(
            lambda: partial().exists() and partial().stat().st_size,
            what="the client's first bytes on disk",
        )
        wait_for(
            lambda: (
                ModelPull.objects.get(pk=pull.pk).done_bytes == partial().stat().st_size
            ),
            what="the row saying the bytes on disk during the stall",
        )
        # More than the client's first chunk came before the hold.
        assert ModelPull.objects.get(pk=pull.pk).done_bytes > (stall.at // 2)
    finally:
        stall.release.set()
        thread.join(timeout=120)
    assert ended == [PullStatus.DONE]


def test_progress_text_says_a_running_pull_with_old_bytes_has_stalled():
    """Bytes last came 7 s ago by the database's clock: stalled, no rate.
    Control: 1 s ago, it reads its rate and time left; a queued pull (no
    run yet) and a finished one never read stalled."""
    now = timezone.now()
    pull = ModelPull(
        name="smol",
        status=PullStatus.RUNNING,
        size_bytes=100 << 20,
        done_bytes=40 << 20,
        rate_bps=10 << 20,
        left_s=6.0,
        progress_at=now - timedelta(seconds=7),
    )
    pull.db_now = now
    assert progress_text(pull) == "40.0%: 40.0 MiB of 100.0 MiB, no bytes for 7 s"
    pull.progress_at = now - timedelta(seconds=1)
    assert progress_text(pull) == ("40.0%: 40.0 MiB of 100.0 MiB, 10.0 MiB/s, 6 s left")
    pull.progress_at = now - timedelta(seconds=7)
    pull.status = PullStatus.QUEUED
    assert progress_text(pull).endswith("10.0 MiB/s, 6 s left")
    pull.status = PullStatus.DONE
    assert progress_text(pull) == "done: 40.0 MiB of 100.0 MiB"


@pytest.mark.django_db(transaction=True)
def test_a_queued_pull_cancelled_ends_at_once(hub):
    pull = pull_cancel(pull=pull_start(source=f"hf:{REPO}:Q4_1", name="q"))
    assert pull.status == PullStatus.CANCELLED
    assert pull_run(pull.pk) == "held elsewhere"  # nothing left to run
    assert hub.bytes_served(REPO, FILE) < 4 << 20


@pytest.mark.django_db(transaction=True)
def test_a_pull_whose_hub_cuts_it_twice_continues_to_the_end(hub):
    """The connection cut at 40% twice: the job tries again, each try
    continuing the partial file. Control: the bytes served are the file
    once, plus at most what the client re-asks past its last written step
    on each cut."""
    hub.cut(REPO, FILE, times=2)
    pull = pull_start(source=f"hf:{REPO}:{FILE}", name="cut")
    assert pull_run(pull.pk) == PullStatus.DONE
    size = hub.blob(REPO, FILE).size
    served = hub.bytes_served(REPO, FILE)
    assert size < served < size + 2 * (0.4 * size)
    assert ModelConfig.objects.filter(name="cut").exists()


@pytest.mark.django_db(transaction=True)
def test_a_hub_that_stalls_mid_file_is_given_up_on_at_a_deadline_and_resumed(
    hub, monkeypatch
):
    """The hub holds the file at 40% and never lets go: after the client's
    read deadline the download continues from what it has with a range
    request, and the pull ends done. Control: the stall was reached and
    never released."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 2)
    stall = hub.stall(REPO, FILE)
    pull = pull_start(source=f"hf:{REPO}:{FILE}", name="stalled")
    assert pull_run(pull.pk) == PullStatus.DONE
    assert stall.reached.is_set() and not stall.release.is_set()
    size = hub.blob(REPO, FILE).size
    assert size <= hub.bytes_served(REPO, FILE) < 2 * size


def test_a_worker_killed_mid_pull_is_resumed_by_the_next_with_only_the_rest(
    hub, transactional_db, tmp_path
):
    """A real worker takes the pull; the hub holds the file at 40% and the
    worker is SIGKILLed there. The next worker to start finds the pull's
    holder gone, queues it again and continues the partial file: the hub
    serves the rest, not the whole file again. Control: what it serves after
    the kill is less than the file."""
    size = hub.blob(REPO, FILE).size
    stall = hub.stall(REPO, FILE)
    log = tmp_path / "worker.log"
    first = start_worker(log)
    try:
        pull = pull_start(source=f"hf:{REPO}:{FILE}", name="resumed")
        assert stall.reached.wait(timeout=120), f"never reached the stall ({log})"
        wait_for(
            lambda: partial().exists() and partial().stat().st_size > 0,
            what="the partial file written before the stall",
        )
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        stop_worker(first)
    kept = partial().stat().st_size
    before = hub.bytes_served(REPO, FILE)
    second = start_worker(log)
    try:
        done = wait_for(
            lambda: (
                ModelPull.objects.filter(pk=pull.pk, status__in=["done", "failed"])
                .values_list("status", "message", "crashes")
                .first()
            ),
            timeout=180,
            what=f"the pull resumed by the second worker ({log})",
        )
    finally:
        stop_worker(second)
    assert done == ("done", "", 1)
    assert hub.bytes_served(REPO, FILE) - before == size - kept < size
    model = ModelConfig.objects.get(name="resumed")
    digest = hashlib.sha256((Path(settings.MODELS_DIR) / model.path).read_bytes())
    assert digest.hexdigest() == hub.blob(REPO, FILE).sha256


@pytest.mark.django_db(transaction=True)
def test_pulls_resume_leaves_a_pull_its_live_holder_runs(hub):
    """A pull whose holder is this live process is not queued again (control:
    once its holder is a process of this host that is gone, it is, with a
    crash counted)."""
    pull = pull_start(source=f"hf:{REPO}:{FILE}", name="held")
    held = ModelPull.objects.filter(pk=pull.pk)
    held.update(
        lease_owner=worker_identity(),
        lease_until=Now() + timedelta(seconds=60),
        status="running",
        queued_at=None,
    )
    assert pulls_resume() == []
    held.update(lease_owner=f"{socket.gethostname()}:999999999:1:ab")
    assert pulls_resume() == [pull.pk]
    assert held.get().crashes == 1
