"""The limits with Redis gone (refusing connections, or silent: its port
dropped), and the one clock and expiring leases of counting in Redis.

Redis unavailable: every request gets a normal answer (limits counted in this
process alone, said on /healthz and logged once), never a 500, and no request
waits on Redis past the timeouts. In Redis: windows by Redis's clock, so
fronts whose clocks disagree share one; concurrency as leases, so a killed
front's slots free themselves within seconds."""

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest
import redis
from django.test import Client

from api import counters, limits
from api.limits import LimitExceeded, key_admission
from tests.conftest import ROOT
from tests.factories import ApiKeyFactory, ModelConfigFactory
from tests.platform.api.limit_checks import (
    REDIS_URL,
    admit,
    concurrency_is_enforced,
    key_with,
    rpm_is_enforced,
)
from tests.waiting import await_for

# A deadline, not a measurement: admission threads blocked on a silent Redis
# for minutes (as before) fail the test.
DEADLINE_S = 30.0


def closed_port() -> int:
    """A port where nothing listens: Redis stopped."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def silent_port():
    """A port whose connections are taken and never answered: a socket that
    listens and never accepts (the kernel completes the handshakes)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        yield listener.getsockname()[1]


@contextlib.contextmanager
def dropped_port():
    """A port whose connection attempts are dropped (a firewall's DROP, as
    the kernel does it to a full accept queue): connecting never completes."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        filler.connect(("127.0.0.1", port))  # the queue's one place, taken
        yield port


def outage_warnings(caplog) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if "Redis unavailable" in record.getMessage()
    ]


async def limits_hold_locally(clock, caplog) -> None:
    """The rate and concurrency limits hold, counted in this process (the
    rate by this process's clock: `clock`), within the deadline; /healthz's
    mode says so; the outage is logged once."""
    caplog.set_level(logging.WARNING, logger="roundhouse.api")
    async with asyncio.timeout(DEADLINE_S):
        await rpm_is_enforced(clock)
        await concurrency_is_enforced()
    assert limits.mode().startswith("local (Redis unavailable: ")
    assert len(outage_warnings(caplog)) == 1


async def test_redis_refusing_connections_counts_locally(settings, clock, caplog):
    """Redis stopped (nothing listens on its port): the limits hold, counted
    in this process; no error reaches the caller (control: before, the
    ConnectionError reached it, a 500)."""
    settings.REDIS_URL = f"redis://127.0.0.1:{closed_port()}/0"
    await limits_hold_locally(clock, caplog)


@pytest.mark.parametrize("blackhole", [silent_port, dropped_port])
async def test_a_blackholed_redis_counts_locally_after_one_timeout(
    blackhole, settings, clock, caplog, monkeypatch
):
    """Redis blackholed (its connections taken and never answered, or never
    completed): the requests in flight when it went silent wait for the
    timeout, then are counted locally; later ones never go to Redis (no
    thread hop) until it answers again (control: without timeouts, the first
    requests never came back)."""
    with blackhole() as port:
        settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"
        key = key_with(pk=9, max_concurrent=64)
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*(admit(key) for _ in range(16)))
        assert not counters.counters().sharing

        def no_thread(*args, **kwargs):
            raise AssertionError("a request went to Redis while it was down")

        monkeypatch.setattr(limits, "_admit_async", no_thread)
        monkeypatch.setattr(limits, "_give_back_async", no_thread)
        await limits_hold_locally(clock, caplog)


def ask(key, model: str):
    return Client().post(
        "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "hi"}]},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key.plaintext}",
    )


@pytest.mark.django_db(transaction=True)
def test_requests_are_answered_when_redis_is_down(settings):
    """Through the front, with Redis stopped: a limited key's request gets
    its normal answer (here 503 no_engine: no engine runs), its third in a
    minute the rate limit's 429, never a 500; /healthz says the limits are
    counted locally (control: before, each was a 500 with a traceback)."""
    settings.REDIS_URL = f"redis://127.0.0.1:{closed_port()}/0"
    model = ModelConfigFactory()
    key = ApiKeyFactory(rpm_limit=2, max_concurrent=1)
    answers = [ask(key, model.name) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [503, 503, 429]
    assert answers[0].json()["error"]["code"] == "no_engine"
    assert answers[2].json()["error"]["code"] == "rate_limit_exceeded"
    limits_now = Client().get("/healthz").json()["limits"]
    assert limits_now.startswith("local (Redis unavailable: ConnectionError")


@pytest.mark.django_db(transaction=True)
def test_healthz_without_redis_says_local(settings):
    """Without REDIS_URL, each process counts its own callers, and says so."""
    settings.REDIS_URL = ""
    assert Client().get("/healthz").json()["limits"] == "local (no REDIS_URL)"


@contextlib.contextmanager
def own_redis(port: int):
    """A Redis server of this test's own on `port` (no persistence)."""
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        yield server
    finally:
        server.terminate()
        server.wait(timeout=30)


async def test_redis_stopped_then_back(settings, caplog):
    """A real Redis stopped mid-run: admission goes on, counted locally
    (logged once); started again, the limits are shared again without a
    request having to wait for it (logged once more)."""
    caplog.set_level(logging.WARNING, logger="roundhouse.api")
    port = closed_port()
    settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"
    shared = counters.counters()
    key = key_with(pk=11, max_concurrent=1)

    async def is_shared() -> bool:
        with contextlib.suppress(LimitExceeded):
            await admit(key)
        return shared.mode() == "shared"

    with own_redis(port):
        await await_for(is_shared, timeout=DEADLINE_S, what="Redis up")
    async with asyncio.timeout(DEADLINE_S):
        await admit(key)
        await concurrency_is_enforced()
    assert shared.mode().startswith("local (Redis unavailable: ")
    with own_redis(port):
        await await_for(is_shared, timeout=DEADLINE_S, what="limits shared again")
    messages = [record.getMessage() for record in caplog.records]
    assert len(outage_warnings(caplog)) >= 1
    assert "limits shared through Redis again" in messages


def answers(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_timeout=1.0).ping()
    except redis.RedisError:
        return False


async def test_requests_held_before_an_outage_still_count(settings):
    """A request admitted through Redis, still running when Redis stops,
    counts in this process's fallback: the caller's next request is refused
    (control: counting only what was admitted during the outage, it got
    in)."""
    port = closed_port()
    settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"
    key = key_with(pk=12, max_concurrent=1)
    held = key_admission(key)
    with own_redis(port):
        await await_for(lambda: asyncio.to_thread(answers, port), what="Redis up")
        await held.__aenter__()
        assert limits.mode() == "shared"
    try:
        with pytest.raises(LimitExceeded):
            await admit(key)
        assert limits.mode().startswith("local (Redis unavailable: ")
    finally:
        await held.__aexit__(None, None, None)
    await admit(key)


# -- one clock, leases (the real Redis) ----------------------------------------


def start_front(code: str) -> subprocess.Popen:
    """Another front process, on the same Redis, running `code`."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
        "DJANGO_SETTINGS_MODULE": "roundhouse.settings",
        "REDIS_URL": REDIS_URL,
    }
    prelude = "import asyncio, django\ndjango.setup()\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


HOLD_TWO_SLOTS = """
from api.limits import key_admission
from api.models import ApiKey

async def main():
    async with key_admission(ApiKey(pk=41, max_concurrent=2), weight=2):
        print("held", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_killed_fronts_slots_free_themselves(redis_limits):
    """A front SIGKILLed while holding slots: its leases are no longer
    renewed, and expire within LEASE_S; another front is then admitted
    (control: with the old ten-minute epochs, still refused at the
    deadline)."""
    front = start_front(HOLD_TWO_SLOTS)
    try:
        line = await asyncio.to_thread(front.stdout.readline)
        assert line.strip() == "held"
        key = key_with(pk=41, max_concurrent=2)
        with pytest.raises(LimitExceeded):
            await admit(key)
    finally:
        front.send_signal(signal.SIGKILL)
        await asyncio.to_thread(front.wait)
        front.stdout.close()

    async def admitted() -> bool:
        try:
            await admit(key)
        except LimitExceeded:
            return False
        return True

    await await_for(admitted, timeout=DEADLINE_S, what="the killed front's slots")


async def test_a_running_request_keeps_its_lease(redis_limits, monkeypatch):
    """A request that runs past its lease's term keeps its slot: the lease is
    renewed while it runs (control: without renewal, a second request is
    admitted once the first term is over)."""
    monkeypatch.setattr(counters, "LEASE_S", 2.0)
    monkeypatch.setattr(counters, "TICK_S", 0.2)
    key = key_with(pk=42, max_concurrent=1)
    async with key_admission(key):
        (member, first_term), *_ = redis_limits.zrange(
            "roundhouse:limits:cc:42", 0, -1, withscores=True
        )

        def past_first_term() -> bool:
            seconds, micros = redis_limits.time()
            return seconds + micros / 1e6 > first_term + 1

        await await_for(
            lambda: asyncio.to_thread(past_first_term),
            timeout=DEADLINE_S,
            what="Redis's clock past the first term",
        )
        with pytest.raises(LimitExceeded):
            await admit(key)
        assert redis_limits.zscore("roundhouse:limits:cc:42", member) > first_term


ADMIT_ONE_A_DAY = """
from api import limits
from api.models import ApiKey

limits.RATE_WINDOW_S = 86400

async def main():
    async with limits.key_admission(ApiKey(pk=43, rpm_limit=2)):
        print("admitted", flush=True)

asyncio.run(main())
"""


async def test_fronts_with_skewed_clocks_share_one_window(
    redis_limits,
    clock,
    monkeypatch,
):
    """Two fronts whose clocks disagree by weeks (this one's set by `clock`)
    count in one window, Redis's: two requests allowed, one here and one
    there, the third here is refused (control: by each front's own clock,
    the windows differ and the third is admitted). Windows of a day, so
    that one does not end during the test."""
    monkeypatch.setattr(limits, "RATE_WINDOW_S", 86400)
    key = key_with(pk=43, rpm_limit=2)
    await admit(key)
    other = start_front(ADMIT_ONE_A_DAY)
    output, _ = await asyncio.to_thread(other.communicate, timeout=DEADLINE_S)
    assert output.strip() == "admitted"
    with pytest.raises(LimitExceeded, match="2 requests per minute"):
        await admit(key)
