"""Production mode against the real Redis (127.0.0.1:6379) on the test
database (PostgreSQL in CI's second pass): REDIS_URL makes Redis the Celery
broker, the channel layer (channels_redis) and the shared cache. A batch runs
through a Redis-brokered worker; a worker SIGKILLed mid-batch is replaced and
every line is answered exactly once; two front processes serve one fleet, and
a group message sent by one reaches a dashboard socket of the other."""

import http.cookiejar
import json
import os
import random
import re
import signal
import urllib.parse
import urllib.request
from collections import Counter

import pytest
import redis
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from websockets.sync.client import connect

from batches.models import BatchLine
from tests.platform import live_platform
from tests.platform.batches.jobs import chat_line, jsonl, records, wait_batch
from tests.platform.live_platform import CHAT, ENGINE
from tests.waiting import wait_for

database = live_platform.database
models_dir_path = live_platform.models_dir_path
orm = live_platform.orm


@pytest.fixture(scope="module")
def redis_url():
    """A Redis database of its own (one of 8-15), emptied first: no message
    of another run is taken for this one's."""
    url = f"redis://127.0.0.1:6379/{random.randint(8, 15)}"
    server = redis.Redis.from_url(url)
    try:
        server.flushdb()
    except redis.ConnectionError:
        pytest.fail("Redis is not running on 127.0.0.1:6379 (.ci/run starts it)")
    yield url
    server.flushdb()


@pytest.fixture(scope="module")
def live(database, django_db_blocker, tmp_path_factory, models_dir_path, redis_url):
    tmp = tmp_path_factory.mktemp("production")
    with live_platform.start_live(
        django_db_blocker, tmp, models_dir_path, env={"REDIS_URL": redis_url}
    ) as platform:
        yield platform


def upload(client, lines) -> str:
    return client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch").id


def test_a_redis_brokered_worker_runs_a_batch(live):
    live.start_worker("redis-worker")
    client = live.client()
    lines = [chat_line(f"r{n}", f"Name a fruit, {n}.", model=CHAT) for n in range(4)]
    batch = client.batches.create(
        input_file_id=upload(client, lines + [b"[]"]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    output = records(client, batch.output_file_id)
    assert [r["custom_id"] for r in output] == [f"r{n}" for n in range(4)]


def test_a_worker_killed_mid_batch_is_replaced_and_every_line_is_answered_once(
    live, orm
):
    """SIGKILL (no goodbye, the lines in flight lost with it) once some lines
    are recorded; a new worker resumes the batch when it starts. Every line
    is answered exactly once, and the ones recorded before the kill keep
    their first answer (never redone)."""
    first = live.start_worker("doomed")
    client = live.client()
    total = 40
    lines = [
        chat_line(f"k{n}", f"Count to {n + 3}.", model=CHAT, max_tokens=24)
        for n in range(total)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 4)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    before = dict(
        BatchLine.objects.filter(batch_id=batch.id).values_list("index", "record")
    )
    assert 4 <= len(before) < total, "the kill came too late to test a resume"

    live.start_worker("successor")
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (total, total, 0)
    output = records(client, batch.output_file_id)
    answered = Counter(record["custom_id"] for record in output)
    assert answered == Counter(f"k{n}" for n in range(total))
    after = dict(
        BatchLine.objects.filter(batch_id=batch.id).values_list("index", "record")
    )
    assert len(after) == total
    assert all(after[index] == record for index, record in before.items())


# -- two fronts -----------------------------------------------------------------


def log_in(port: int, username: str, password: str) -> http.cookiejar.CookieJar:
    """Log in through the login form, as a browser does; the cookies."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    url = f"http://127.0.0.1:{port}/accounts/login/"
    page = opener.open(url, timeout=30).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    form = {"username": username, "password": password, "csrfmiddlewaretoken": token}
    opener.open(url, urllib.parse.urlencode(form).encode(), timeout=30)
    assert any(cookie.name == "sessionid" for cookie in jar), "login failed"
    return jar


def test_a_group_message_from_one_front_reaches_a_socket_of_another(live, orm):
    """A dashboard open on front B; an operator's order posted to front A:
    its notice (a group message A sends) arrives on B's socket."""
    username, password = f"ops-{os.urandom(3).hex()}", os.urandom(12).hex()
    operator = get_user_model().objects.create_user(
        username, password=password, is_staff=True
    )
    # Loading from the dashboard needs the permission to change models.
    operator.user_permissions.add(Permission.objects.get(codename="change_modelconfig"))
    port_a, port_b = live.port, live.start_front("front-b")
    jar = log_in(port_a, username, password)  # one session, both fronts
    cookies = "; ".join(f"{c.name}={c.value}" for c in jar)
    with connect(
        f"ws://127.0.0.1:{port_b}/ws/dashboard/",
        additional_headers={"Cookie": cookies, "Origin": f"http://127.0.0.1:{port_b}"},
        open_timeout=30,
    ) as socket:
        assert json.loads(socket.recv(timeout=30))["type"] == "fleet"
        csrf = next(c.value for c in jar if c.name == "csrftoken")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port_a}/dashboard/engines/{ENGINE}/load/",
            data=urllib.parse.urlencode({"model": CHAT}).encode(),
            headers={
                "Cookie": cookies,
                "X-CSRFToken": csrf,
                "Referer": f"http://127.0.0.1:{port_a}/dashboard/",
            },
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status in (200, 202)

        def notice() -> dict | None:  # fleet updates come every second meanwhile
            message = json.loads(socket.recv(timeout=60))
            return message if message["type"] == "notice" else None

        message = wait_for(notice, timeout=60, interval=0, what="a notice at front B")
    assert message["text"].startswith(f"Loaded {CHAT} on {ENGINE}"), message
