"""The pages in a real browser: Debian's chromium, headless, driven by
Playwright, against the live platform (uvicorn front, `manage.py supervise`,
a real engine serving SmolLM2), as a person uses them.

Without /usr/bin/chromium these tests are skipped, unless
ROUNDHOUSE_REQUIRE_BROWSER is set (CI sets it, and installs chromium)."""

import re
from datetime import timedelta

from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.utils import timezone
from playwright.sync_api import expect

from api.models import Usage
from catalog.leases import worker_identity
from catalog.models import ModelPull
from chat.models import Conversation, Message
from fleet.models import EngineState
from tests.platform import live_platform
from tests.platform.chat import browser as chromium
from tests.platform.chat.browser import TIMEOUT_MS, answer, restart_front, sampling
from tests.platform.live_platform import CHAT, ENGINE
from tests.waiting import wait_for

# The live platform of the API tests (one engine serving SmolLM2 and MiniLM),
# started once for this module too.
database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm
browser = chromium.browser
page = chromium.page


def usage_written(page, count: int) -> None:
    """Wait for the live front to write the usage rows of the page's answers
    (a background writer does, after each answer): the teardown deletes the
    user, and a row written after that would reference no user."""
    wait_for(
        lambda: Usage.objects.filter(user=page.user).count() >= count,
        timeout=30,
        what=f"{count} usage rows written",
    )


def test_chat_streams_stops_regenerates_and_comes_back(page, live):
    """Send a message: the answer streams in, with its tokens/s and time to
    first token; the conversation is listed and its URL kept. Stop halts a
    long answer; regenerate replaces the last answer. Reloading shows the
    stored conversation."""
    expect(page.locator("#connection")).to_have_text("connected")
    expect(page.locator("#model")).to_have_value(CHAT)
    sampling(page, max_tokens=12, temperature=0)
    page.fill("#prompt", "Name a colour.")
    page.press("#prompt", "Enter")
    first = answer(page, 0)
    expect(first.locator(".stats")).to_contain_text("first token", timeout=TIMEOUT_MS)
    expect(first.locator(".stats")).to_contain_text("tokens")
    assert first.locator(".body").inner_text().strip()
    expect(page).to_have_url(re.compile(r"/chat/\d+/$"))
    expect(page.locator("#conversation-list li.current")).to_contain_text(
        "Name a colour."
    )

    # Stop: a long answer is cut short, and says so.
    sampling(page, max_tokens=400)
    page.fill("#prompt", "Write a very long essay about harbours.")
    page.press("#prompt", "Enter")
    second = answer(page, 1)
    expect(second.locator(".body")).not_to_be_empty()
    page.click("#stop")
    expect(second.locator(".stats")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_enabled()

    # Regenerate: the last answer is replaced, not added to.
    sampling(page, max_tokens=6)
    page.click("#regenerate")
    expect(second.locator(".stats")).to_contain_text("tokens")
    expect(second.locator(".stats")).not_to_contain_text("stopped")
    assert page.locator(".message.assistant").count() == 2

    conversation_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    stored = Conversation.objects.get(pk=conversation_id)
    assert stored.user_id == page.user.pk

    def regenerated_stored():
        """The turns once the regenerated answer is stored (after its `done`):
        the stopped answer replaced, not added to."""
        roles = list(stored.messages.values_list("role", "finish_reason"))
        return roles[-1][1] in ("stop", "length") and roles

    roles = wait_for(regenerated_stored, timeout=30, what="the new answer stored")
    assert [role for role, _ in roles] == ["user", "assistant", "user", "assistant"]

    page.reload()
    expect(page.locator(".message")).to_have_count(4)
    expect(page.locator(".message.user").first).to_have_text("Name a colour.")
    usage_written(page, 3)  # the first, the stopped and the regenerated answer


def test_markdown_is_rendered_and_sanitised(page, live):
    """A stored answer with a code block and an injected script renders the
    code block and runs nothing."""
    conversation = Conversation.objects.create(user=page.user, model=CHAT, title="md")
    Message.objects.create(conversation=conversation, role="user", content="show me")
    Message.objects.create(
        conversation=conversation,
        role="assistant",
        content=(
            "Here:\n\n```python\nprint('hi')\n```\n\n"
            '<img src="x" onerror="window.pwned=1"><script>window.pwned=2</script>'
        ),
    )
    page.goto(f"{live.base_url}/chat/{conversation.pk}/")
    expect(page.locator(".message.assistant pre code")).to_contain_text("print('hi')")
    assert page.locator(".message.assistant script").count() == 0
    assert page.locator(".message.assistant img[onerror]").count() == 0
    assert page.evaluate("window.pwned") is None
    # Another user's conversation is not shown to this one.
    other = get_user_model().objects.create_user("someone-else")
    theirs = Conversation.objects.create(user=other, model=CHAT, title="private")
    response = page.goto(f"{live.base_url}/chat/{theirs.pk}/")
    assert response.status == 404


def test_chat_reconnects_after_the_socket_drops(page, live):
    """The front restarts under the page: the page says it is disconnected,
    reconnects by itself, and the next message is answered."""
    expect(page.locator("#connection")).to_have_text("connected")
    front = restart_front(live)
    try:
        expect(page.locator("#connection")).to_contain_text("reconnecting")
        expect(page.locator("#connection")).to_have_text("connected")
        sampling(page, max_tokens=4)
        page.fill("#prompt", "Hello again.")
        page.press("#prompt", "Enter")
        # The new front's first request (it reads the fleet first): a bound
        # for a busy machine, not a speed check.
        expect(answer(page, 0).locator(".stats")).to_contain_text(
            "tokens", timeout=30_000
        )
        usage_written(page, 1)
    finally:
        live.front_pid = front.pid


# The pixels each of an engine's charts has drawn in its series' colour
# (#2364aa, anti-aliased: blue well above red, nearly opaque), in card order:
# tokens/s, queue depth, memory.
CHART_PIXELS = """(engine) => {
  const card = document.querySelector(`.card[data-engine="${engine}"]`);
  return Array.from(card ? card.querySelectorAll(".charts canvas") : [], (canvas) => {
    const context = canvas.getContext("2d");
    const { data } = context.getImageData(0, 0, canvas.width, canvas.height);
    let drawn = 0;
    for (let i = 0; i < data.length; i += 4) {
      if (data[i + 3] > 128 && data[i + 2] - data[i] > 80) drawn++;
    }
    return drawn;
  });
}"""


def test_dashboard_shows_the_engine_and_restarts_it(page, live):
    """The dashboard's card for the engine: ready, its pid, the chat model
    resident with its memory. Restart from it: recorded in the admin's
    history, and the card shows the new process when it is up. (The user
    may change engines: restarting needs it.)"""
    page.user.user_permissions.add(Permission.objects.get(codename="change_enginespec"))
    page.goto(f"{live.base_url}/dashboard/")
    card = page.locator(f'.card[data-engine="{ENGINE}"]')
    expect(card.locator(".badge")).to_have_text("ready")
    expect(page.locator("#connection")).to_have_text("live")
    pid = EngineState.objects.get(spec__name=ENGINE).pid
    expect(card).to_contain_text(str(pid))
    expect(card).to_contain_text("slots in use")
    # Its charts draw: the memory chart (never empty for a running engine)
    # has drawn its series, not only a canvas.
    page.wait_for_function(
        f"() => ({CHART_PIXELS})({ENGINE!r})[2] > 0", timeout=TIMEOUT_MS
    )
    assert len(page.evaluate(CHART_PIXELS, ENGINE)) == 3
    card.locator("button.restart").click()
    expect(page.locator("#flash")).to_contain_text(f"Restart of {ENGINE} requested")
    assert LogEntry.objects.filter(
        change_message="Restart requested from the dashboard."
    ).exists()
    new_pid = wait_for(
        lambda: (
            (s := EngineState.objects.get(spec__name=ENGINE)).status == "ready"
            and s.pid != pid
            and s.pid
        ),
        what="the engine restarted",
    )
    expect(card.locator("dd").first).to_have_text(str(new_pid))
    expect(card.locator(".badge")).to_have_text("ready")


def test_dashboard_shows_this_hosts_disk_and_the_pulls_in_progress(
    page, live, models_dir_path
):
    """One host: a Disk line with the models directory's used and free room
    and the chat model's files with their size; a pull running shows with
    its percent, and is gone once it is over (control: the list follows the
    rows, it is not painted once)."""
    gguf = models_dir_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    mib = int(round(gguf.stat().st_size / 2**20, 2) + 0.5)  # as the page rounds
    pull = ModelPull.objects.create(
        source="hf:org/repo-GGUF:Q4_K_M",
        name="pulled-now",
        status="running",
        size_bytes=100 << 20,
        done_bytes=45 << 20,
        rate_bps=5 << 20,
        left_s=11,
        # Held by this live process: no worker of the platform resumes it.
        lease_owner=worker_identity(),
        lease_until=timezone.now() + timedelta(hours=1),
    )
    try:
        page.goto(f"{live.base_url}/dashboard/")
        expect(page.locator("#connection")).to_have_text("live")
        disk = page.locator('p.disk[data-disk-node=""]')
        expect(disk).to_contain_text("(this host)")
        expect(disk).to_contain_text("free of")
        expect(disk).to_contain_text(f"{CHAT} {mib} MiB")
        row = page.locator('li.pull[data-pull="pulled-now"]')
        expect(row).to_contain_text("running")
        expect(row).to_contain_text("45% of 100 MiB")
        expect(row).to_contain_text("5 MiB/s")
        expect(row).to_contain_text("11 s left")
        ModelPull.objects.filter(pk=pull.pk).update(status="done")
        expect(row).to_have_count(0)
    finally:
        ModelPull.objects.filter(pk=pull.pk).delete()
