"""The database down: API keys this process remembers keep working, any other
key gets 503 with Retry-After, nothing answers 500, background work swallows
nothing unseen, and the outage is logged once, not once per request.

The outages are real. "unreachable": new connections go to a closed port
(PostgreSQL) or to a file that cannot be opened (SQLite), and the open ones are
closed. "refusing" (PostgreSQL, the reliability bench's fault): the database
accepts no connection and its sessions are terminated."""

import asyncio
import gc
import logging
import time
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django import db
from django.test import Client
from django.utils import timezone

from api import calls, gateway, services
from api.gateway import front_gateway
from api.models import ApiKey
from fleet.models import EngineState
from fleet.selectors import HEARTBEAT_STALE_S, routing_snapshot
from routing.select import ModelRoute, Snapshot
from tests.factories import ApiKeyFactory, EngineSpecFactory, ModelConfigFactory
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "outage-chat"
UNAVAILABLE = "the database is unavailable"


@pytest.fixture
def fleet_in_memory(own_gateway):
    """A routing snapshot that needs no database: one chat model."""
    snapshot = Snapshot(engines={}, models={CHAT: ModelRoute(CHAT, "gguf", "chat")})
    own_gateway(lambda: snapshot)


def models_with(plaintext: str, address: str = "10.0.0.1"):
    return Client().get(
        "/v1/models", HTTP_AUTHORIZATION=f"Bearer {plaintext}", REMOTE_ADDR=address
    )


def outage_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if UNAVAILABLE in r.getMessage()]


def test_the_outage_is_real(outage):
    """The control: while it lasts, a query fails with the driver's own error,
    in this thread and in the gateway's loader; afterwards both work."""
    ApiKeyFactory()
    outage.start()
    # What the bench saw, on PostgreSQL refusing connections.
    refused = None
    if outage.kind == "refusing":
        refused = "not currently accepting connections"
    with pytest.raises(db.OperationalError, match=refused):
        ApiKey.objects.exists()
    with pytest.raises(db.OperationalError, match=refused):
        front_gateway().in_loader_thread(front_gateway().fleet_load)
    outage.end()
    assert ApiKey.objects.exists()
    front_gateway().in_loader_thread(front_gateway().fleet_load)


def test_a_remembered_key_keeps_working(outage, fleet_in_memory, caplog, monkeypatch):
    """The bench's 500: a remembered key whose last use was recorded over a
    minute ago. Its last use is not recorded while the database is down, and
    its requests succeed all the same, also once it is older than KEY_STALE_S
    (used as last read). One log line for the
    outage, one when it is over; the last use is recorded again then."""
    key = ApiKeyFactory()
    assert models_with(key.plaintext).status_code == 200  # remembered
    remembered = services._recent_keys[key.key_hash][0]
    over_a_minute = timezone.now() - timedelta(minutes=2)
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=over_a_minute)
    remembered.last_used_at = over_a_minute

    outage.start()
    statuses = [models_with(key.plaintext).status_code for _ in range(3)]
    monkeypatch.setattr(services, "KEY_STALE_S", 0.0)
    statuses += [models_with(key.plaintext).status_code for _ in range(3)]
    assert statuses == [200] * 6
    assert len(outage_logs(caplog)) == 1
    outage.end()

    assert ApiKey.objects.get(pk=key.pk).last_used_at == over_a_minute
    remembered.last_used_at = over_a_minute  # as a minute later
    assert models_with(key.plaintext).status_code == 200
    assert ApiKey.objects.get(pk=key.pk).last_used_at > over_a_minute
    assert "the database is available again" in caplog.text
    assert len(outage_logs(caplog)) == 1


def test_an_old_remembered_key_costs_no_lookup_in_an_outage(
    outage, fleet_in_memory, monkeypatch
):
    """Older than KEY_STALE_S while the database is down, a remembered key is
    used with no lookup on the request's path (each would wait out the
    database's connect timeout, one after another: a cluster node's front
    answered nothing for a minute). Control: with the database up, the same
    key is looked up again."""
    key = ApiKeyFactory()
    assert models_with(key.plaintext).status_code == 200  # remembered
    lookups = []
    looked_up = services._key_looked_up

    async def counted(**kwargs):
        lookups.append(kwargs["digest"])
        return await looked_up(**kwargs)

    monkeypatch.setattr(services, "_key_looked_up", counted)
    monkeypatch.setattr(services, "KEY_STALE_S", 0.0)
    outage.start()
    models_with(key.plaintext)  # the first finds the database down
    lookups.clear()
    assert [models_with(key.plaintext).status_code for _ in range(3)] == [200] * 3
    assert lookups == []
    outage.end()
    services.DATABASE_OUTAGE.worked()  # as the next revalidation finds
    assert models_with(key.plaintext).status_code == 200
    assert lookups == [key.key_hash]


def test_a_key_not_remembered_is_503_until_the_database_is_back(
    outage, fleet_in_memory
):
    """Unknown or not yet seen, a key cannot be checked: 503 with Retry-After,
    not counted against the client's failed keys (no 429 however many). The
    control: once the database is back, the same requests get 401 and 200."""
    key = ApiKeyFactory()
    outage.start()
    answers = [
        models_with(plaintext)
        for plaintext in ["rh-unknown", key.plaintext]
        * (services.AUTH_FAILURES.limit + 2)
    ]
    assert {answer.status_code for answer in answers} == {503}
    error = answers[0].json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "database_unavailable")
    assert int(answers[0]["Retry-After"]) >= 1
    outage.end()
    assert models_with("rh-unknown").status_code == 401
    assert models_with(key.plaintext).status_code == 200


def test_a_fleet_that_cannot_be_read_is_503_and_health_still_answers(outage):
    """With no routing snapshot in memory and the database down, a request is
    a 503 (not a 500); /healthz and /metrics answer all the same."""
    key = ApiKeyFactory()
    assert models_with(key.plaintext).status_code == 200  # key remembered
    front_gateway().cache.clear()
    outage.start()
    answer = models_with(key.plaintext)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "database_unavailable"
    completion = Client().post(
        "/v1/chat/completions",
        {"model": CHAT, "messages": [{"role": "user", "content": "hi"}]},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key.plaintext}",
    )
    assert completion.status_code == 503
    assert "Retry-After" in completion
    health = Client().get("/healthz")
    assert health.status_code == 200
    assert health.json()["engines"] == {}
    assert Client().get("/metrics").status_code == 200


def test_a_long_outage_routes_on_the_last_snapshot(
    outage, monkeypatch, caplog, own_gateway
):
    """Past the snapshot's stale limit, with the database still down, requests
    route on the last snapshot read, however old (the model is still listed
    for a remembered key), and the outage is logged once. The first waits for
    its load, which fails; the others answer from memory at once while one
    reload at a time tries the database in the background. The control (the
    test above): with no snapshot in memory, the same request is a 503."""
    loads = []

    def load():
        loads.append(1)
        return front_gateway().fleet_load()

    own_gateway(load, max_age_s=0)
    monkeypatch.setattr(gateway, "STALE_LIMIT_S", 0.0)
    monkeypatch.setattr(gateway, "RELOAD_AFTER_FAILURE_S", 0.0)  # try each time
    model = ModelConfigFactory()
    key = ApiKeyFactory()
    listed = models_with(key.plaintext)
    assert model.name in {item["id"] for item in listed.json()["data"]}
    outage.start()
    before = len(loads)
    answers = [models_with(key.plaintext) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [200] * 3
    assert model.name in {item["id"] for item in answers[-1].json()["data"]}
    # The first request's load failed, and the next started one in the
    # background (the loader, one thread, runs what it is given in order).
    front_gateway().in_loader_thread(lambda: None)
    assert len(loads) - before >= 2
    assert len(outage_logs(caplog)) == 1
    outage.end()
    assert models_with(key.plaintext).status_code == 200
    front_gateway().in_loader_thread(lambda: None)  # its reload in the background
    # The fleet read again ends the outage, so that the next one is logged.
    assert "the database is available again" in caplog.text


def test_heartbeats_missed_in_an_outage_are_not_a_dead_supervisor(outage):
    """The bench's 503s after the database came back: the supervisor could not
    write heartbeats while it was down, and routing took a healthy engine for
    down until it wrote again. The gateway counts a heartbeat's age without the
    outage it saw. Controls: the same rows read with no grace show the engine
    down, and so does the gateway once the outage is long past."""

    def load():
        return front_gateway().in_loader_thread(front_gateway().fleet_load)

    spec = EngineSpecFactory(name="e1")
    heartbeat = timezone.now() - timedelta(seconds=HEARTBEAT_STALE_S - 1)
    EngineState.objects.create(spec=spec, status="ready", heartbeat_at=heartbeat)
    assert load().engines["e1"].up  # 9 s old: fresh
    outage.start()
    with pytest.raises(db.OperationalError):
        load()
    began = front_gateway().outages.began

    def asked_again_two_seconds_in() -> bool:
        """Asked again, as routing would, while the database is down: whether
        the outage has lasted 2 s by then (heartbeats 11 s old)."""
        with pytest.raises(db.OperationalError):
            load()
        return time.monotonic() - began >= 2.0

    # Time is the condition: the gateway measures the outage on its own
    # monotonic clock, and the heartbeat must age past HEARTBEAT_STALE_S while
    # the database is down.
    wait_for(asked_again_two_seconds_in, interval=0.1, what="an outage of 2 s")
    outage.end()
    assert load().engines["e1"].up
    assert front_gateway().outages.last[1] - front_gateway().outages.last[0] >= 2.0
    assert not routing_snapshot().engines["e1"].up  # stale without the grace
    began, ended = front_gateway().outages.last
    front_gateway().outages.last = (began - 60, ended - 60)  # a minute ago: no grace
    assert not load().engines["e1"].up


def test_a_kept_connection_the_server_closed_is_not_an_outage():
    """The loader thread keeps its connection between loads; the server may
    close it meanwhile (a restart, an idle timeout, a terminated session). The
    next load reconnects at once: no error, no outage counted (a node of a
    cluster idle past UNREACHABLE_AFTER_S refused its next request as
    unconfirmed). Control: the query on the closed connection itself fails."""
    if db.connection.vendor != "postgresql":
        pytest.skip("the server closes a session on PostgreSQL only")

    in_loader = front_gateway().in_loader_thread
    front_gateway().close()
    EngineSpecFactory(name="e1")
    assert "e1" in in_loader(front_gateway().fleet_load).engines
    pid = in_loader(lambda: db.connection.connection.info.backend_pid)
    with db.connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])

    def query_the_kept_connection():
        with db.connection.connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    with pytest.raises(Exception, match="terminat|closed"):
        in_loader(query_the_kept_connection)
    assert "e1" in in_loader(front_gateway().fleet_load).engines
    assert front_gateway().outages.began is None
    assert in_loader(lambda: db.connection.connection.info.backend_pid) != pid


async def test_revalidation_waits_for_the_database(outage, monkeypatch):
    """A stale remembered key is read again after the request; while the
    database is down that read fails quietly: the key stays remembered and
    waiting, and is not tried again for REVALIDATE_RETRY_S. Once the database
    is back, the next revalidation sees a revocation made meanwhile."""
    key = await sync_to_async(ApiKeyFactory)()
    header = f"Bearer {key.plaintext}"
    await services.api_key_authenticate(authorization=header)
    monkeypatch.setattr(services, "KEY_CACHE_S", 0.0)
    await services.api_key_authenticate(authorization=header)  # stale now
    assert services.stale_keys_waiting()

    await sync_to_async(outage.start)()  # in the thread the lookups use
    await services.api_keys_revalidate()
    assert not services.stale_keys_waiting()  # not again at once
    assert await services.api_key_authenticate(authorization=header)
    monkeypatch.setattr(services, "REVALIDATE_RETRY_S", 0.0)
    assert services.stale_keys_waiting()
    await calls.spawn(services.api_keys_revalidate(), "reading API keys again")
    assert key.key_hash in services._recent_keys
    await sync_to_async(outage.end)()

    await ApiKey.objects.filter(pk=key.pk).aupdate(revoked_at=timezone.now())
    await services.api_keys_revalidate()
    with pytest.raises(services.KeyRejected):
        await services.api_key_authenticate(authorization=header)


async def test_background_failures_are_logged_not_left_unretrieved(caplog):
    """A background task that fails is logged by name, and its exception is
    retrieved: asyncio has nothing to report when it is collected. The
    control: a task nobody retrieves is reported."""
    loop = asyncio.get_running_loop()
    reports: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reports.append(context["message"]))

    async def failing() -> None:
        raise db.OperationalError("the database went away")

    try:
        spawned = calls.spawn(failing(), "doing background work")
        await asyncio.wait([spawned])
        await asyncio.sleep(0)  # its done callbacks run
        del spawned
        gc.collect()
        assert reports == []
        assert "doing background work failed" in caplog.text
        assert "the database went away" in caplog.text

        bare = asyncio.ensure_future(failing())
        await asyncio.wait([bare])
        del bare
        gc.collect()
        assert reports == ["Task exception was never retrieved"]
    finally:
        loop.set_exception_handler(previous)


@pytest.fixture(autouse=True)
def api_logs(caplog):
    caplog.set_level(logging.INFO, logger="roundhouse.api")
