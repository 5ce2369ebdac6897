"""The pages in a real browser: Debian's chromium, headless, driven by
Playwright, against the live platform, for the browser tests. Importing it skips
the importing module without /usr/bin/chromium, unless ROUNDHOUSE_REQUIRE_BROWSER
is set (CI sets it, and installs chromium)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connections

from tests.conftest import ROOT
from tests.waiting import wait_for

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    if os.environ.get("ROUNDHOUSE_REQUIRE_BROWSER"):
        raise RuntimeError("ROUNDHOUSE_REQUIRE_BROWSER is set but chromium is missing")
    pytest.skip("no /usr/bin/chromium (apt install chromium)", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

PASSWORD = "browser-test-password"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser(live):
    """Chromium, once the platform runs. Playwright's sync API runs an event
    loop in this thread, under which Django refuses ORM calls unless told
    that this thread's calls are safe (they are: the loop is Playwright's
    and never runs Django code)."""
    allowed = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield chromium
        chromium.close()
    if allowed is None:
        del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = allowed


@pytest.fixture
def page(browser, live, orm):
    """A browser page logged in as a new staff user."""
    user = get_user_model().objects.create_user(
        f"person{get_user_model().objects.count()}",
        password=PASSWORD,
        is_staff=True,
    )
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.goto(f"{live.base_url}/chat/")
    expect(page).to_have_url(re.compile(r"/accounts/login/"))
    page.fill("input[name=username]", user.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    expect(page).to_have_url(re.compile(r"/chat/$"))
    page.user = user
    yield page
    context.close()
    get_user_model().objects.filter(username__startswith="person").delete()
    get_user_model().objects.filter(username="someone-else").delete()
    # Under Playwright's running loop the ORM keeps this test's connection in
    # a context of its own, which the test database's teardown cannot see:
    # closed here, or PostgreSQL refuses to drop the database.
    connections.close_all()


def sampling(page, **fields) -> None:
    """Set sampling fields, opening their section as a person would."""
    if not page.locator("#settings details").evaluate("details => details.open"):
        page.click("#settings summary")
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


def answer(page, index: int):
    return page.locator(".message.assistant").nth(index)


def restart_front(live) -> subprocess.Popen:
    """Stop the live front and start another on its port, as before."""
    os.kill(live.front_pid, signal.SIGTERM)
    wait_for(lambda: not listening(live), timeout=30, what="the front stopped")
    process = subprocess.Popen(
        [sys.executable, "-m", "roundhouse.serve", "--port", str(live.port)],
        cwd=ROOT,
        env={**os.environ, **live.env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    live.processes.append(process)
    return process


def listening(live) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", live.port)) == 0
