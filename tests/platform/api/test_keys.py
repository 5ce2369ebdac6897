"""API keys: only a hash is stored; bearer authentication, models, last use."""

import asyncio
import hashlib
import io
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from api import services
from api.models import ApiKey
from api.services import (
    KeyRejected,
    LimitExceeded,
    api_key_allows,
    api_key_authenticate,
    api_key_create,
    api_key_hash,
    api_key_revoke,
)
from tests.factories import ApiKeyFactory, ModelConfigFactory

transactional = pytest.mark.django_db(transaction=True)


@pytest.mark.django_db
def test_only_the_hash_is_stored():
    """The plaintext is returned once; the row and a full dump hold only its hash."""
    key, plaintext = api_key_create(name="ci", rpm_limit=5, max_concurrent=2)

    assert plaintext.startswith("rh-") and len(plaintext) > 40
    assert key.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert plaintext.startswith(key.prefix) and len(key.prefix) < 16
    row = ApiKey.objects.get(pk=key.pk)
    values = [
        str(getattr(row, field.attname)) for field in ApiKey._meta.concrete_fields
    ]
    assert not any(plaintext in value for value in values)
    dump = io.StringIO()
    call_command("dumpdata", stdout=dump)
    assert key.key_hash in dump.getvalue()
    assert plaintext not in dump.getvalue()
    assert plaintext[len(key.prefix) :] not in dump.getvalue()


@pytest.mark.django_db
def test_keys_are_distinct():
    """Every key gets its own secret."""
    secrets = {api_key_create(name=f"k{n}")[1] for n in range(20)}
    assert len(secrets) == 20


@transactional
async def test_authenticate_returns_the_key():
    """A valid bearer key authenticates to its row (scheme case-insensitive)."""
    key = await sync_to_async(ApiKeyFactory)()
    for header in (f"Bearer {key.plaintext}", f"bearer  {key.plaintext} "):
        found = await api_key_authenticate(authorization=header)
        assert found.pk == key.pk


@transactional
@pytest.mark.parametrize("header", [None, "", "   "])
async def test_missing_key_is_rejected(header):
    """No Authorization header: rejected, and told how to send a key."""
    with pytest.raises(KeyRejected, match="didn't provide an API key") as rejected:
        await api_key_authenticate(authorization=header)
    assert rejected.value.code == "invalid_api_key"


@transactional
@pytest.mark.parametrize(
    "header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer a b", "rh-abcdefgh", "Token x"]
)
async def test_malformed_header_is_rejected(header):
    """Anything but `Bearer <one token>` is rejected as malformed."""
    with pytest.raises(KeyRejected, match="Malformed Authorization header"):
        await api_key_authenticate(authorization=header)


@transactional
async def test_unknown_key_is_rejected_and_not_echoed():
    """An unknown key is rejected; the message shows only its start and end."""
    await sync_to_async(ApiKeyFactory)()
    sent = "rh-" + "A" * 20 + "secretmiddle" + "Z" * 20
    with pytest.raises(KeyRejected) as rejected:
        await api_key_authenticate(authorization=f"Bearer {sent}")
    message = rejected.value.message
    assert message.startswith("Incorrect API key provided: rh-AAAA...ZZZZ.")
    assert sent not in message and "secretmiddle" not in message


@transactional
@pytest.mark.parametrize("sent", ["x", "abc", "abcdefgh", "k" * 300])
async def test_short_and_long_unknown_keys_are_never_echoed(sent):
    """However short or long the sent key, the message never contains all of it."""
    with pytest.raises(KeyRejected, match="Incorrect API key") as rejected:
        await api_key_authenticate(authorization=f"Bearer {sent}")
    assert sent not in rejected.value.message


@transactional
async def test_revoked_key_is_rejected():
    """A revoked key is refused, naming its prefix only."""
    key = await sync_to_async(ApiKeyFactory)()
    await sync_to_async(api_key_revoke)(key=key)
    with pytest.raises(KeyRejected, match="has been revoked") as rejected:
        await api_key_authenticate(authorization=f"Bearer {key.plaintext}")
    assert key.prefix in rejected.value.message
    assert key.plaintext not in rejected.value.message


@pytest.mark.django_db
def test_revoke_is_idempotent():
    """Revoking twice keeps the first revocation time."""
    key = ApiKeyFactory()
    api_key_revoke(key=key)
    first = ApiKey.objects.get(pk=key.pk).revoked_at
    api_key_revoke(key=key)
    assert first is not None
    assert ApiKey.objects.get(pk=key.pk).revoked_at == first


@transactional
async def test_allowed_models_need_no_query():
    """Allowed models come with the key: checking them runs no query (a query on
    the event loop would raise SynchronousOnlyOperation)."""
    chat, other = await sync_to_async(ModelConfigFactory.create_batch)(2)
    limited = await sync_to_async(ApiKeyFactory)(allowed_models=[chat])
    unlimited = await sync_to_async(ApiKeyFactory)()

    limited = await api_key_authenticate(authorization=f"Bearer {limited.plaintext}")
    unlimited = await api_key_authenticate(
        authorization=f"Bearer {unlimited.plaintext}"
    )

    assert limited.allowed_model_names == frozenset({chat.name})
    assert api_key_allows(key=limited, model=chat.name)
    assert not api_key_allows(key=limited, model=other.name)
    assert not api_key_allows(key=limited, model="no-such-model")
    assert api_key_allows(key=unlimited, model=other.name)
    assert api_key_allows(key=unlimited, model="no-such-model")


@pytest.mark.django_db
def test_created_key_knows_its_models():
    """api_key_create stores the allowed models and sets their names on the key."""
    chat = ModelConfigFactory()
    key, _ = api_key_create(name="limited", allowed_models=[chat])
    assert list(ApiKey.objects.get(pk=key.pk).allowed_models.all()) == [chat]
    assert api_key_allows(key=key, model=chat.name)
    assert not api_key_allows(key=key, model="other")
    assert api_key_allows(key=ApiKey.objects.get(pk=key.pk), model=chat.name)


async def _last_used(key: ApiKey):
    return (await ApiKey.objects.aget(pk=key.pk)).last_used_at


@transactional
async def test_last_used_is_written_at_most_once_a_minute():
    """The first use is recorded; a use within a minute of the recorded one is not
    written; a use more than a minute later is."""
    key = await sync_to_async(ApiKeyFactory)()
    header = f"Bearer {key.plaintext}"
    assert await _last_used(key) is None

    await api_key_authenticate(authorization=header)
    first = await _last_used(key)
    assert first is not None

    recent = timezone.now() - timedelta(seconds=30)
    await ApiKey.objects.filter(pk=key.pk).aupdate(last_used_at=recent)
    services._recent_keys.clear()  # as once KEY_CACHE_S has passed
    await api_key_authenticate(authorization=header)
    assert await _last_used(key) == recent

    stale = timezone.now() - timedelta(minutes=2)
    await ApiKey.objects.filter(pk=key.pk).aupdate(last_used_at=stale)
    services._recent_keys.clear()
    found = await api_key_authenticate(authorization=header)
    assert await _last_used(key) > stale
    assert found.last_used_at == await _last_used(key)


@transactional
async def test_a_recent_key_needs_no_database_read(monkeypatch):
    """Within KEY_CACHE_S the key comes from memory; revoking it in this process
    takes effect at once; revoked elsewhere, at the first revalidation after
    KEY_CACHE_S (which runs after the request that found the entry stale)."""
    key = await sync_to_async(ApiKeyFactory)()
    header = f"Bearer {key.plaintext}"
    reads = []
    real = services.api_key_get_by_hash

    async def counted(**kwargs):
        reads.append(kwargs)
        return await real(**kwargs)

    monkeypatch.setattr(services, "api_key_get_by_hash", counted)
    for _ in range(3):
        await api_key_authenticate(authorization=header)
    assert len(reads) == 1

    await ApiKey.objects.filter(pk=key.pk).aupdate(revoked_at=timezone.now())
    await api_key_authenticate(authorization=header)  # elsewhere: not seen yet
    monkeypatch.setattr(services, "KEY_CACHE_S", 0.0)
    await api_key_authenticate(authorization=header)  # stale: used, then checked
    assert services.stale_keys_waiting()
    await services.api_keys_revalidate()
    assert len(reads) == 2
    with pytest.raises(KeyRejected):
        await api_key_authenticate(authorization=header)

    other = await sync_to_async(ApiKeyFactory)()
    other_header = f"Bearer {other.plaintext}"
    monkeypatch.setattr(services, "KEY_CACHE_S", 60.0)
    await api_key_authenticate(authorization=other_header)
    await sync_to_async(api_key_revoke)(key=other)
    with pytest.raises(KeyRejected):
        await api_key_authenticate(authorization=other_header)


# -- unknown keys are cheap ---------------------------------------------------


def models_as(address: str, plaintext: str):
    """GET /v1/models from a client at `address` (the test client runs the view
    in this thread, so its queries are on this thread's connection)."""
    return Client().get(
        "/v1/models", HTTP_AUTHORIZATION=f"Bearer {plaintext}", REMOTE_ADDR=address
    )


@pytest.fixture
def throttle_clock(monkeypatch):
    """The failed-key throttle's clock, at `now[0]` seconds."""
    now = [1000.0]
    monkeypatch.setattr(services.AUTH_FAILURES, "clock", lambda: now[0])
    return now


@transactional
def test_a_flood_of_bad_keys_makes_a_bounded_number_of_queries(throttle_clock):
    """Distinct bad keys from one client are each looked up until the client
    has failed AUTH_FAILURES.limit times; the rest are refused with 429 and no
    query. The same bad key from many clients is looked up once."""
    limit = services.AUTH_FAILURES.limit
    with CaptureQueriesContext(connection) as queries:
        statuses = [
            models_as("10.0.0.1", f"rh-flood-{n}").status_code for n in range(5 * limit)
        ]
    assert statuses == [401] * limit + [429] * (4 * limit)
    assert 1 <= len(queries) <= limit  # the lookups are seen: they are counted

    with CaptureQueriesContext(connection) as queries:
        statuses = [models_as(f"10.0.1.{n}", "rh-same").status_code for n in range(50)]
    assert statuses == [401] * 50
    assert len(queries) == 1


@transactional
async def test_concurrent_bad_keys_of_one_client_are_bounded_too(monkeypatch):
    """Many bad keys at once from one client: lookups in flight count as
    failures, so no more than the limit are made, not one per request."""
    limit = services.AUTH_FAILURES.limit
    lookups = count_lookups(monkeypatch)
    outcomes = await asyncio.gather(
        *(
            api_key_authenticate(authorization=f"Bearer rh-at-once-{n}", client="a")
            for n in range(10 * limit)
        ),
        return_exceptions=True,
    )
    assert sum(isinstance(o, KeyRejected) for o in outcomes) == limit
    assert sum(isinstance(o, LimitExceeded) for o in outcomes) == 9 * limit
    assert len(lookups) == limit


async def models_asgi(key: str, client: str = "10.0.0.7") -> int:
    """The status of GET /v1/models with `key`, from `client`, through the
    front's ASGI application as the server hands it a request."""
    from roundhouse.asgi import api_application

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/v1/models",
        "raw_path": b"/v1/models",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Bearer {key}".encode()),
        ],
        "client": (client, 40000),
        "server": ("127.0.0.1", 8000),
    }
    sent = []
    answered = asyncio.Event()
    requested = []

    async def receive():
        if not requested:
            requested.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    await api_application(scope, receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


@transactional
async def test_a_burst_of_one_good_key_is_answered_beside_a_flood_of_bad_ones(
    monkeypatch,
):
    """64 requests at once with one valid key whose cache entry is cold (as
    after a minute idle), from one address (every client behind a reverse
    proxy), while 64 bad keys come from the same address: every good request
    is answered (200) with one database read between them, and the bad keys
    are throttled (429 after AUTH_FAILURES.limit refusals). Control: counting
    each lookup as a failure before it looks (the old order) answered the
    21st concurrent good request 429."""
    key = await sync_to_async(ApiKeyFactory)()
    limit = services.AUTH_FAILURES.limit
    lookups = count_lookups(monkeypatch)
    requests = [models_asgi(key.plaintext) for _ in range(64)]
    requests += [models_asgi(f"rh-guess-{n}") for n in range(64)]
    statuses = await asyncio.gather(*requests)
    good, bad = statuses[:64], statuses[64:]
    assert good == [200] * 64
    assert sorted(set(bad)) == [401, 429] and bad.count(401) <= limit
    assert sum(1 for x in lookups if x["key_hash"] == key.key_hash) == 1
    assert len(lookups) <= limit + 1


@transactional
def test_a_good_key_works_during_a_flood(throttle_clock):
    """While one client is throttled, another client's key works; from the
    throttled client, a key remembered from an earlier request still works (it
    costs no lookup) and any other key is refused before its lookup."""
    used, unused = ApiKeyFactory(), ApiKeyFactory()
    for n in range(services.AUTH_FAILURES.limit + 5):
        models_as("10.0.0.1", f"rh-flood-{n}")
    assert models_as("10.0.0.1", "rh-flood-more").status_code == 429

    assert models_as("10.0.0.2", used.plaintext).status_code == 200
    assert models_as("10.0.0.1", used.plaintext).status_code == 200
    with CaptureQueriesContext(connection) as queries:
        assert models_as("10.0.0.1", unused.plaintext).status_code == 429
    assert len(queries) == 0
    assert models_as("10.0.0.2", unused.plaintext).status_code == 200


@transactional
def test_the_throttle_says_when_to_retry_and_ends_with_its_window(throttle_clock):
    """Over its failed keys, a client gets 429 with Retry-After (the seconds
    left in its window); once the window is over its keys are looked up again."""
    window = services.AUTH_FAILURES.window_s
    for n in range(services.AUTH_FAILURES.limit):
        assert models_as("10.0.0.1", f"rh-bad-{n}").status_code == 401
    refused = models_as("10.0.0.1", "rh-bad-next")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_invalid_keys"
    assert int(refused["Retry-After"]) == window

    throttle_clock[0] += window - 10
    refused = models_as("10.0.0.1", "rh-bad-next")
    assert (refused.status_code, refused["Retry-After"]) == (429, "10")

    throttle_clock[0] += 10
    with CaptureQueriesContext(connection) as queries:
        assert models_as("10.0.0.1", "rh-bad-next").status_code == 401
    assert len(queries) == 1


@transactional
async def test_a_key_issued_after_it_was_refused_works_at_once(monkeypatch):
    """A refused key is refused again from memory; issuing that key in this
    process forgets the refusal. (The secret is fixed so that the test can
    present it before it exists.)"""
    monkeypatch.setattr(services.secrets, "token_urlsafe", lambda n: "fixed-secret")
    header = "Bearer rh-fixed-secret"
    lookups = count_lookups(monkeypatch)
    for _ in range(2):
        with pytest.raises(KeyRejected, match="Incorrect API key"):
            await api_key_authenticate(authorization=header)
    assert len(lookups) == 1  # the second refusal came from memory

    key, plaintext = await sync_to_async(api_key_create)(name="late")
    assert plaintext == "rh-fixed-secret"
    assert (await api_key_authenticate(authorization=header)).pk == key.pk


@transactional
async def test_a_key_created_elsewhere_works_once_the_refusal_expires(monkeypatch):
    """Created by another process (this one saw no api_key_issue), a key
    refused moments ago stays refused for REFUSED_KEY_CACHE_S, then works."""
    plaintext = "rh-made-elsewhere"
    with pytest.raises(KeyRejected):
        await api_key_authenticate(authorization=f"Bearer {plaintext}")
    await ApiKey.objects.acreate(
        name="elsewhere", prefix=plaintext[:11], key_hash=api_key_hash(plaintext)
    )
    with pytest.raises(KeyRejected):
        await api_key_authenticate(authorization=f"Bearer {plaintext}")
    monkeypatch.setattr(services, "REFUSED_KEY_CACHE_S", 0.0)
    assert await api_key_authenticate(authorization=f"Bearer {plaintext}")


@transactional
async def test_revoked_keys_are_refused_from_memory_too(monkeypatch):
    """A revoked key, refused once, is refused again with no lookup."""
    key = await sync_to_async(ApiKeyFactory)()
    await sync_to_async(api_key_revoke)(key=key)
    lookups = count_lookups(monkeypatch)
    for _ in range(3):
        with pytest.raises(KeyRejected, match="has been revoked"):
            await api_key_authenticate(authorization=f"Bearer {key.plaintext}")
    assert len(lookups) == 1


@transactional
async def test_refused_keys_in_memory_are_bounded(monkeypatch):
    """At most REFUSED_KEY_CACHE_SIZE refusals are remembered, the newest."""
    monkeypatch.setattr(services, "REFUSED_KEY_CACHE_SIZE", 5)
    for n in range(12):
        with pytest.raises(KeyRejected):
            await api_key_authenticate(authorization=f"Bearer rh-bad-{n}")
    assert len(services._refused_keys) == 5
    assert api_key_hash("rh-bad-11") in services._refused_keys
    assert api_key_hash("rh-bad-0") not in services._refused_keys


def count_lookups(monkeypatch) -> list:
    """The database lookups of keys made from here on."""
    lookups = []
    real = services.api_key_get_by_hash

    async def counted(**kwargs):
        lookups.append(kwargs)
        return await real(**kwargs)

    monkeypatch.setattr(services, "api_key_get_by_hash", counted)
    return lookups
