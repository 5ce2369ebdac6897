"""Prompt-cache affinity and cache reuse are scoped by caller: two API keys
(or users) sending the same messages share neither the front's affinity
(here through a real Redis, shared by every front) nor the engine's cache
(the cache salt each request carries); the same key finds its own; a model
whose catalog row sets `share_prompt_cache_across_owners` shares both."""

import pytest
from asgiref.sync import sync_to_async

from api.affinity import SharedAffinity
from api.calls import Call
from api.choices import call_requests
from api.gateway import front_gateway
from api.pipeline import model_route
from api.schemas import ChatCompletionRequest
from routing.select import EngineStatus
from tests.factories import ApiKeyFactory, ModelConfigFactory
from tests.platform.api.clean_slate import close_background_connections

pytestmark = pytest.mark.django_db(transaction=True)

# The database number this test module's keys go in (no other test uses 1).
REDIS_URL = "redis://127.0.0.1:6379/1"
MESSAGES = [
    {"role": "system", "content": "You answer for the harbour office."},
    {"role": "user", "content": "Is berth 7 free on the 12th? Code TIDE-4411."},
]
FLEET = {
    name: EngineStatus(name, "cpu", frozenset({"gguf"}), True, incarnation="t1")
    for name in ("ea", "eb")
}


async def made(factory, **fields):
    """A row made by a factory, off the event loop (a key with its models
    read, as authentication leaves it)."""
    row = await sync_to_async(factory)(**fields)
    if hasattr(row, "allowed_models"):
        row.allowed_model_names = frozenset()
    return row


@pytest.fixture(autouse=True)
def _fresh_fleet():
    """Each test reads the catalog rows it made (not the last test's fleet),
    and closes the snapshot loader's connections after."""
    front_gateway().cache.clear()
    yield
    front_gateway().cache.clear()
    close_background_connections()


async def routed(model: str, **caller) -> tuple[tuple[str, ...], str | None]:
    """A chat request's prefix keys and engine cache salt, for this caller."""
    call = Call("chat.completions", **caller)
    await model_route(call, model)
    payload = ChatCompletionRequest.model_validate(
        {"model": model, "messages": MESSAGES}
    )
    [request] = call_requests(payload, "interactive", call=call)
    return call.prefixes, request.cache_salt


async def test_two_keys_sending_the_same_prefix_share_no_affinity_or_cache(
    django_user_model,
):
    """Key a's conversation, remembered by one front as sent to eb, is not
    found by another front for key b (nor for a user), and their requests
    carry different cache salts; key a's next request finds eb and carries
    a's salt again."""
    model = (await made(ModelConfigFactory, name="scoped")).name
    key_a, key_b = await made(ApiKeyFactory), await made(ApiKeyFactory)
    user = await django_user_model.objects.acreate(username="u")
    front_1, front_2 = SharedAffinity(REDIS_URL), SharedAffinity(REDIS_URL)
    keys_a, salt_a = await routed(model, key=key_a)
    front_1.remember(keys_a, FLEET["eb"])
    await front_1.settled()
    keys_b, salt_b = await routed(model, key=key_b)
    keys_user, salt_user = await routed(model, user=user)
    assert await front_2.lookup(keys_b, FLEET) == ""
    assert await front_2.lookup(keys_user, FLEET) == ""
    assert len({salt_a, salt_b, salt_user}) == 3 and None not in {salt_a, salt_b}
    again, salt_again = await routed(model, key=key_a)
    assert await front_2.lookup(again, FLEET) == "eb"
    assert salt_again == salt_a


async def test_a_model_shared_across_owners_shares_affinity_and_cache():
    """Control: with share_prompt_cache_across_owners set, key b finds the
    engine key a's conversation went to, and neither request carries a salt
    (the engine's one shared cache)."""
    model = (
        await made(
            ModelConfigFactory, name="shared", share_prompt_cache_across_owners=True
        )
    ).name
    key_a, key_b = await made(ApiKeyFactory), await made(ApiKeyFactory)
    front_1, front_2 = SharedAffinity(REDIS_URL), SharedAffinity(REDIS_URL)
    keys_a, salt_a = await routed(model, key=key_a)
    front_1.remember(keys_a, FLEET["ea"])
    await front_1.settled()
    keys_b, salt_b = await routed(model, key=key_b)
    assert keys_b == keys_a
    assert await front_2.lookup(keys_b, FLEET) == "ea"
    assert salt_a is None and salt_b is None


def test_redis_database_one_is_reachable():
    """The module's Redis database answers (else the tests above would pass
    on each front's own map alone, which proves less)."""
    import redis

    assert redis.Redis.from_url(REDIS_URL).ping()
