"""Prompt-cache affinity shared by the fronts through a real Redis
(platform/api/affinity.py): a conversation routed by one front is routed to
the same engine by another; a restarted engine is not preferred for what its
last start served; without Redis, or with Redis gone, each front routes on its
own map and no request waits long or fails."""

import asyncio
import logging
import secrets

import redis

from api.affinity import (
    CONNECT_TIMEOUT_S,
    KEY_PREFIX,
    LOOKUP_TIMEOUT_S,
    TTL_S,
    SharedAffinity,
)
from routing.affinity import prefix_keys
from routing.select import EngineStatus
from tests.engines.conftest import free_port

REDIS_URL = "redis://127.0.0.1:6379/4"


def engines(**incarnations: str) -> dict[str, EngineStatus]:
    return {
        name: EngineStatus(name, "cpu", frozenset(), True, incarnation=started)
        for name, started in incarnations.items()
    }


def conversation() -> tuple[str, ...]:
    """The prefix keys of a conversation no other test has."""
    messages = [{"role": "user", "content": f"hello {secrets.token_hex(8)}"}]
    return prefix_keys("smol", messages)


async def test_a_conversation_routed_by_one_front_is_found_by_another():
    """Front a sent the conversation to engine eb; front b, which never saw it,
    finds eb. Control: a front without Redis finds nothing."""
    a, b = SharedAffinity(REDIS_URL), SharedAffinity(REDIS_URL)
    fleet = engines(ea="t1", eb="t1")
    keys = conversation()
    a.remember(keys, fleet["eb"])
    await a.settled()
    assert await b.lookup(keys, fleet) == "eb"
    # A longer conversation (its next turn) is found by its known prefix.
    longer = prefix_keys("smol", [{"role": "user", "content": "x"}]) + keys
    assert await b.lookup(longer, fleet) == "eb"
    assert await SharedAffinity("").lookup(keys, fleet) == ""  # control
    assert await b.lookup(keys, fleet, shared=False) == ""  # b's own map


async def test_a_burst_of_routed_requests_is_written_in_batches():
    """A thousand requests routed at once: their prefixes are queued and
    written by one task in a few round trips over the lane's few connections
    (not one connection each), and every one is then found by another front
    with the engine it went to."""
    a, b = SharedAffinity(REDIS_URL), SharedAffinity(REDIS_URL)
    fleet = engines(ea="t1", eb="t1")
    burst = [conversation() for _ in range(1000)]
    for index, keys in enumerate(burst):
        a.remember(keys, fleet["ea" if index % 2 else "eb"])
    await a.settled()
    assert a.sharing
    found = [await b.lookup(keys, fleet) for keys in burst]
    assert found == ["ea" if index % 2 else "eb" for index in range(1000)]


async def test_redis_keeps_two_prefixes_with_an_expiry_and_no_text():
    """Of a three-message request Redis keeps the longest prefix (what the
    next turn carries) and the first (a shared system prompt), each a hash
    with an expiry naming an engine and its start: nothing of the messages.
    The next turn, sent to another front, finds the engine by the longest."""
    front = SharedAffinity(REDIS_URL)
    secret = f"my card is {secrets.token_hex(8)}"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": secret},
        {"role": "assistant", "content": "Noted."},
    ]
    keys = prefix_keys("smol", messages)
    front.remember(keys, engines(ea="t1")["ea"])
    await front.settled()
    client = redis.Redis.from_url(REDIS_URL)
    try:
        longest, middle, first = keys
        stored = client.mget([KEY_PREFIX + key for key in keys])
        assert stored == [b"ea t1", None, b"ea t1"]
        assert 0 < client.ttl(KEY_PREFIX + longest) <= TTL_S
        assert secret.encode() not in b"".join(client.keys(KEY_PREFIX + "*"))
    finally:
        client.close()
    next_turn = prefix_keys("smol", [*messages, {"role": "user", "content": "And?"}])
    assert await SharedAffinity(REDIS_URL).lookup(next_turn, engines(ea="t1")) == "ea"


async def test_a_restarted_engine_is_not_preferred_for_its_last_starts_cache():
    """eb restarted since it served the conversation (another incarnation):
    its cache holds nothing of it, so no front prefers it, from Redis or its
    own map. Control: the same start still is."""
    front = SharedAffinity(REDIS_URL)
    keys = conversation()
    front.remember(keys, engines(eb="t1")["eb"])
    await front.settled()
    assert await front.lookup(keys, engines(eb="t1")) == "eb"  # control
    assert await front.lookup(keys, engines(eb="t2")) == ""
    assert await front.lookup(keys, engines(eb="t2"), shared=False) == ""
    assert await front.lookup(keys, engines(ea="t1")) == ""  # eb is gone


async def test_without_redis_a_front_routes_on_its_own_map(caplog):
    """Redis cannot be reached: the lookup answers from this front's map
    (within the lookup's bound), remembering still works, the outage is
    logged once, and Redis is not tried again at once."""
    front = SharedAffinity(f"redis://127.0.0.1:{free_port()}/0")
    fleet = engines(ea="t1")
    keys = conversation()
    assert front.sharing  # control: tried at first
    with caplog.at_level(logging.WARNING, logger="roundhouse.affinity"):
        front.remember(keys, fleet["ea"])
        await front.settled()
        for _ in range(3):
            assert await front.lookup(keys, fleet) == "ea"
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert not front.sharing  # left alone for a while


async def test_a_redis_that_does_not_answer_is_given_up_after_a_few_lookups():
    """A Redis that accepts connections but never answers (a hung server):
    each lookup gives up after LOOKUP_TIMEOUT_S (the first, which connects,
    after CONNECT_TIMEOUT_S) and answers from this front's map; after a few
    in a row Redis is left alone."""
    accepted: list[asyncio.StreamWriter] = []

    async def hang(reader, writer):
        accepted.append(writer)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    front = SharedAffinity(f"redis://127.0.0.1:{port}/0")
    fleet = engines(ea="t1")
    keys = conversation()
    front.local.remember(keys, "ea t1")
    try:
        for lookup in range(3):
            bound = CONNECT_TIMEOUT_S if lookup == 0 else LOOKUP_TIMEOUT_S
            async with asyncio.timeout(bound + 1):
                assert await front.lookup(keys, fleet) == "ea"
        assert accepted  # it did reach the hung server
        assert not front.sharing
    finally:
        for writer in accepted:
            writer.close()
        server.close()
