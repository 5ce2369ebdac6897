"""A pull's admin page in Chromium while the pull runs: its progress moves
without a reload (its script polls the pull's progress under the front's
Content Security Policy), then it says done and links the model. The pull is
held mid-file by the local hub (tests/hub.py Stall) and run by
pull_jobs.pull_run in a thread, as a worker would run it."""

import re
import threading
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.urls import reverse
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect

from catalog.models import ModelPull, PullStatus
from catalog.pull_jobs import pull_run, pull_start
from tests.hub import LocalHub
from tests.platform.chat import browser as chromium
from tests.platform.chat.browser import PASSWORD, TIMEOUT_MS

pytestmark = pytest.mark.django_db(transaction=True)

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "org/SmolLM2-135M-GGUF"
FILE = "smol.Q4_1.gguf"


# Chromium, from the browser tests' helpers (started after `live`).
browser = chromium.browser


@pytest.fixture(scope="module")
def live(live_server):
    """What the browser fixture starts after: Django's live server, in this
    process on the test database, is all these pages need."""
    return live_server


@pytest.fixture
def hub(monkeypatch, settings, tmp_path):
    smol = Path(settings.MODELS_DIR) / SMOL
    settings.MODELS_DIR = tmp_path / "models"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # The stall lasts as long as the test looks at the page: the client must
    # not give up on it meanwhile (and resume past it).
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DOWNLOAD_TIMEOUT", 300)
    with LocalHub({REPO: {FILE: smol}}) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)
        yield local


@pytest.fixture
def page(browser, live_server):
    """A browser page logged in to the admin as a superuser."""
    user = get_user_model().objects.create_superuser(
        "puller", "puller@example.com", PASSWORD
    )
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("input[name=username]", user.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("input[type=submit]")
    expect(page).to_have_url(re.compile(r"/admin/$"))
    yield page
    context.close()


def running_pull(pull_id: int) -> threading.Thread:
    """pull_run in a thread of its own, as a worker would run it."""

    def run() -> None:
        try:
            pull_run(pull_id)
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_pull_page_shows_progress_moving_then_done(page, hub, live_server):
    """Its figures change while it runs, then done with the model's link; the
    browser reports no error (a script the policy blocked would be one)."""
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pull = pull_start(source=f"hf:{REPO}:Q4_1", name="smol-live")
    first = hub.stall(REPO, FILE, fraction=0.4)
    thread = running_pull(pull.pk)
    try:
        assert first.reached.wait(60), "the download never reached the stall"
        page.goto(
            live_server.url + reverse("admin:catalog_modelpull_change", args=[pull.pk])
        )
        expect(page.locator("#pull-status")).to_have_text("running", timeout=TIMEOUT_MS)
        bar = page.locator("#pull-bar")
        page.wait_for_function(
            "() => document.getElementById('pull-bar').value > 0", timeout=TIMEOUT_MS
        )
        assert bar.evaluate("bar => bar.value") <= first.at  # held at the stall
        text = page.locator("#pull-text")
        expect(text).to_have_text(
            re.compile(r"^\d+\.\d%: .+ of .+ left$"), timeout=TIMEOUT_MS
        )
        shown = text.text_content()

        # Held again further on: the page follows past the first stall,
        # without a reload.
        second = hub.stall(REPO, FILE, fraction=0.8)
        first.release.set()
        assert second.reached.wait(60), "the download never reached the second stall"
        try:
            page.wait_for_function(
                "at => document.getElementById('pull-bar').value > at",
                arg=first.at,
                timeout=TIMEOUT_MS,
            )
        except PlaywrightTimeout:
            # What the row and the page said (a failure seen once, in a full
            # PostgreSQL run, never alone): which side stopped moving.
            row = ModelPull.objects.filter(pk=pull.pk).values().first()
            raise AssertionError(
                f"the bar never passed {first.at}: page bar "
                f"{bar.evaluate('bar => bar.value')}, text {text.text_content()!r}; "
                f"row {row}"
            ) from None
        expect(text).not_to_have_text(shown, timeout=TIMEOUT_MS)
        expect(page.locator("#pull-status")).to_have_text("running", timeout=TIMEOUT_MS)

        second.release.set()
        expect(page.locator("#pull-status")).to_have_text("done", timeout=TIMEOUT_MS)
        expect(text).to_contain_text("done: ", timeout=TIMEOUT_MS)
        expect(page.locator("#pull-model a")).to_have_text(
            "smol-live", timeout=TIMEOUT_MS
        )
        assert bar.evaluate("bar => bar.value === bar.max")
        expect(page.locator("#pull-cancel")).to_be_hidden(timeout=TIMEOUT_MS)
        assert errors == []
    finally:
        first.release.set()
        thread.join(60)
    pull.refresh_from_db()
    assert pull.status == PullStatus.DONE
