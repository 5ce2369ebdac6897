"""API keys: only a hash is stored; bearer authentication, models, last use."""

import hashlib
import io
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.utils import timezone

from api import services
from api.models import ApiKey
from api.services import (
    KeyRejected,
    api_key_allows,
    api_key_authenticate,
    api_key_create,
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
