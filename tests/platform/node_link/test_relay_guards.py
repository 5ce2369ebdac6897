"""What a peer, or anyone who reaches a relay's port, can do to a node: the
relay's bounds (platform/node_link/admission.py, link_gate.py, link_relay.py)
against a real engine, with callers on several loopback addresses (127.0.0.x
are all this host's)."""

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys

import psutil
import pytest
from node_link import relay as link_relay
from node_link.admission import (
    FAILED_HELLOS_PER_ADDRESS,
    HANDSHAKE_S,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_ADDRESS,
    MAX_LOOKUPS,
    REFUSED,
)
from node_link.client import LinkPool, NodeUnreachable, Peer
from node_link.gate import MAX_LINK_REQUEST_BYTES
from node_link.protocol import MAX_STREAM_ID, OPEN, LinkRefused, link_frame
from node_link.relay import (
    MAX_LINK_HELD_BYTES,
    MAX_STREAMS_PER_LINK,
    link_proof,
)

from cluster.tls import relay_certificate, server_tls_context
from engines.launch.config import LiveConfig
from engines.wire.client import EngineRequestError, EngineUnreachable
from engines.wire.framing import HEADER, decode_message, encode_message, read_frame
from engines.wire.requests import GenerateRequest, ShutdownRequest, TokenizeRequest
from tests.conftest import ROOT
from tests.engines.conftest import free_port
from tests.engines.generating import SMOL
from tests.platform.node_link.links import GREEDY, SECRET, relay_for, remote
from tests.waiting import await_for


async def idle_connection(port: int, source: str):
    """A connection from `source` that sends nothing."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_by_relay(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the relay closed this connection within `within` seconds."""
    try:
        async with asyncio.timeout(within):
            return await reader.read() == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def relay_side_connections(port: int) -> int:
    """Connections this process holds open as the relay (local port `port`)."""
    return sum(
        1
        for connection in psutil.Process().net_connections(kind="tcp")
        if connection.laddr
        and connection.laddr.port == port
        and connection.status == psutil.CONN_ESTABLISHED
    )


# -- before authentication (point 1) ---------------------------------------------


async def test_idle_connections_are_capped_per_address_and_in_total(
    engine, monkeypatch
):
    """Connections that never say hello, from one address and then from 300:
    the relay holds MAX_HANDSHAKES_PER_ADDRESS of one address's and
    MAX_HANDSHAKES in all, closing the rest at once, and a link made before
    serves all the while (control: without the caps the relay held every
    one). The handshake bound is lifted here, so that none closes by it."""
    monkeypatch.setattr(link_relay, "HANDSHAKE_S", 600)
    held = []
    async with relay_for(engine) as (relay, port):
        client, pool = remote(port)
        assert (await client.ping()).status == "ok"
        try:
            for _ in range(MAX_HANDSHAKES_PER_ADDRESS + 1):
                held.append(await idle_connection(port, "127.0.0.2"))
            assert await closed_by_relay(held[-1][0], within=30)
            assert relay.handshakes.pending == MAX_HANDSHAKES_PER_ADDRESS
            for index in range(300):
                source = f"127.0.{1 + index // 200}.{1 + index % 200}"
                held.append(await idle_connection(port, source))
            await await_for(
                lambda: relay_side_connections(port) <= MAX_HANDSHAKES + 1,
                timeout=30,
                what="the connections over the cap closed",
            )
            assert relay.handshakes.pending == MAX_HANDSHAKES
            assert (await client.ping()).status == "ok"  # the link made before
        finally:
            for _, writer in held:
                writer.close()
        await await_for(lambda: relay.handshakes.pending == 0, what="slots back")
        pool.close()


async def test_a_connection_that_says_nothing_is_closed_after_the_handshake_bound(
    engine, tmp_path
):
    """Plain TCP or TLS, a connection that never finishes its handshake and
    hello is closed after HANDSHAKE_S (control: the hello's own 10 s, TLS's
    default 60 s)."""
    assert HANDSHAKE_S <= 2.0
    key, cert, _ = relay_certificate(tmp_path, "b")
    for tls in (None, server_tls_context(key, cert)):
        async with relay_for(engine, tls=tls) as (relay, port):
            reader, writer = await idle_connection(port, "127.0.0.4")
            # Within a few seconds, not the hello's 10 or TLS's 60.
            assert await closed_by_relay(reader, within=6.0)
            writer.close()
            await await_for(lambda: relay.handshakes.pending == 0, what="its slot back")


async def test_every_refusal_reads_the_same_and_a_failing_address_is_not_looked_up(
    engine, caplog
):
    """An unknown node, a wrong secret and a bad hello get the same answer
    (nothing says which names exist); after FAILED_HELLOS_PER_ADDRESS
    failures an address is refused without a lookup, even with the secret,
    while another address is served; the log says so in a line or two, not
    one per refusal."""
    checked: list[str] = []
    async with relay_for(engine, checked=checked) as (relay, port):
        answers = set()
        with caplog.at_level(logging.WARNING, logger="roundhouse.relay"):
            for attempt in range(FAILED_HELLOS_PER_ADDRESS + 5):
                reader, writer = await idle_connection(port, "127.0.0.5")
                hello = (
                    {"kind": "link", "version": 1, "node": "zz", "secret": SECRET},
                    {"kind": "link", "version": 1, "node": "a", "secret": "guess"},
                    {"kind": "not a hello"},
                )[attempt % 3]
                writer.write(encode_message(hello))
                answers.add(await read_frame(reader))
                writer.close()
            # The right secret, from the address that kept failing.
            reader, writer = await idle_connection(port, "127.0.0.5")
            hello = {"kind": "link", "version": 1, "node": "a", "secret": SECRET}
            writer.write(encode_message(hello))
            answers.add(await read_frame(reader))
            writer.close()
        assert len(answers) == 1, answers
        refusal = decode_message(answers.pop())
        assert (refusal["code"], refusal["message"]) == ("unauthorized", "link refused")
        assert len(checked) <= FAILED_HELLOS_PER_ADDRESS
        refusals = [r for r in caplog.records if "relay refused" in r.getMessage()]
        assert 1 <= len(refusals) <= 2, caplog.text
        client, pool = remote(port)  # 127.0.0.1: not throttled
        assert (await client.ping()).status == "ok"
        pool.close()


def hello(secret: str = SECRET) -> bytes:
    """Node a's hello, with `secret`."""
    return encode_message({"kind": "link", "version": 1, "node": "a", "secret": secret})


async def test_at_most_max_lookups_of_hellos_run_at_once(engine, monkeypatch):
    """MAX_LOOKUPS + 8 hellos at once, from as many addresses, while each
    lookup waits on the database: MAX_LOOKUPS are looked up at once and the
    others wait their turn; once the lookups go on, every hello is looked up
    and answered (control: every hello had reached the lookups when they
    were counted, so more than MAX_LOOKUPS could have run)."""
    monkeypatch.setattr(link_relay, "HANDSHAKE_S", 600)
    hellos = MAX_LOOKUPS + 8
    looking_up, most, looked_up = 0, 0, 0
    go_on = asyncio.Event()

    async def lookup(node: str, secret: str) -> None:
        nonlocal looking_up, most, looked_up
        looking_up += 1
        most = max(most, looking_up)
        try:
            await go_on.wait()
        finally:
            looking_up -= 1
            looked_up += 1

    async with relay_for(engine, lookup=lookup) as (relay, port):
        # A hello is checked for its address's failures just before its
        # lookup: counted there, it has reached the lookups.
        reached: list[str] = []
        throttled = relay._failed.throttled
        monkeypatch.setattr(
            relay._failed,
            "throttled",
            lambda address: reached.append(address) or throttled(address),
        )
        connections = []
        try:
            for index in range(hellos):
                reader, writer = await idle_connection(port, f"127.0.3.{index + 1}")
                writer.write(hello("a wrong secret"))
                connections.append((reader, writer))
            await await_for(
                lambda: len(reached) == hellos, what="every hello at the lookups"
            )
            assert looking_up == MAX_LOOKUPS
            go_on.set()
            for reader, _ in connections:
                answer = decode_message(await read_frame(reader))
                assert answer["message"] == REFUSED, answer
            assert looked_up == hellos and most == MAX_LOOKUPS
        finally:
            for _, writer in connections:
                writer.close()


async def test_an_unexpected_error_with_one_connection_drops_that_one_alone(
    engine, caplog
):
    """A lookup that raises what nobody expected (not a refusal, not the
    database unavailable), twice: each connection is closed, the error is
    logged once (the relay's refusal log, rate-limited), nothing reaches the
    event loop's handler of unhandled errors, and the next link is welcomed
    and serves (control: the log line names the error, so the relay's own
    guard caught it)."""
    failures = {"left": 2}

    async def lookup(node: str, secret: str) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("a lookup no one expected to fail")

    loop = asyncio.get_running_loop()
    unhandled: list[dict] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda loop, context: unhandled.append(context))
    try:
        async with relay_for(engine, lookup=lookup) as (_, port):
            with caplog.at_level(logging.WARNING, logger="roundhouse.relay"):
                for _ in range(2):
                    reader, writer = await idle_connection(port, "127.0.0.6")
                    writer.write(hello())
                    assert await closed_by_relay(reader, within=10)
                    writer.close()
            logged = [
                record
                for record in caplog.records
                if "a lookup no one expected to fail" in record.getMessage()
            ]
            assert len(logged) == 1, caplog.text
            assert "unexpected error" in logged[0].getMessage()
            assert failures["left"] == 0
            client, pool = remote(port)
            assert (await client.ping()).status == "ok"
            pool.close()
    finally:
        loop.set_exception_handler(handler)
    assert unhandled == []


async def child_relay(port: int, engine, *, caps: bool):
    """tests/platform/node_link/relay_child.py, started; its process and the
    lines it printed so far (appended as they come)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}"}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.platform.node_link.relay_child",
        str(port),
        *([] if caps else ["--no-caps"]),
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    given = {"secret": SECRET, "port": engine.port, "token": engine.token}
    child.stdin.write(json.dumps(given).encode() + b"\n")
    await child.stdin.drain()
    child.stdin.close()
    lines: list[str] = []

    async def read() -> None:
        while line := await child.stdout.readline():
            lines.append(line.decode().strip())

    reading = asyncio.ensure_future(read())
    await await_for(lambda: "listening" in lines, timeout=60, what="the child relay")
    return child, lines, reading


def beats(lines: list[str], outcome: str) -> int:
    return sum(1 for line in lines if line.startswith("beat") and outcome in line)


async def flood_a_child_relay(engine, *, caps: bool) -> None:
    """300 idle connections, from 300 addresses, against the relay of
    relay_child.py (allowed 256 open files); with `caps`, what the process
    still does then is checked, else that it ran out of files."""
    port = free_port()
    child, lines, reading = await child_relay(port, engine, caps=caps)
    before, pool = remote(port)

    async def new_link_serves() -> bool:
        client, new_pool = remote(port)
        try:
            return (await client.ping()).status == "ok"
        except NodeUnreachable:  # refused while the handshakes are full
            return False
        finally:
            new_pool.close()

    held = []
    try:
        if caps:
            assert (await before.ping()).status == "ok"
        for index in range(300):
            source = f"127.0.{4 + index // 200}.{1 + index % 200}"
            held.append(await idle_connection(port, source))
        if not caps:
            await await_for(
                lambda: beats(lines, "failed"),
                timeout=30,
                what="a beat failing for lack of files",
            )
            assert any("Too many open files" in line for line in lines), lines
            return
        ok = beats(lines, "ok")
        await await_for(
            lambda: beats(lines, "ok") >= ok + 5, timeout=30, what="more beats"
        )
        assert (await before.ping()).status == "ok"
        await await_for(new_link_serves, timeout=30, what="a new link served")
        await await_for(
            lambda: beats(lines, "ok") >= ok + 10, timeout=30, what="more beats"
        )
        assert beats(lines, "failed") == 0, lines
        assert child.returncode is None
    finally:
        pool.close()
        for _, writer in held:
            writer.close()
        child.kill()
        await child.wait()
        await reading


async def test_a_relay_allowed_256_files_outlives_300_idle_connections(engine):
    """Issue 31's repro: a relay in a process allowed 256 open files, 300
    idle unauthenticated connections held open against it from 300
    addresses. The process lives, the heartbeat thread beside the relay
    still opens its socket and file at every beat, a link made before the
    flood serves through it, and a new link is welcomed once the idle
    connections' handshake bound has passed (with the 300 still held open
    by the attacker). Control: the same process with the admission's caps
    lifted runs out of files under the same flood (its beats fail)."""
    await flood_a_child_relay(engine, caps=True)
    await flood_a_child_relay(engine, caps=False)


# -- what a link carries (points 4, 6, 15) -------------------------------------------


async def test_a_link_carries_inference_but_never_configure_or_shutdown(engine):
    """Over a link, ping and generation work; configure and shutdown are
    refused by the relay, which never sends them on: the engine still serves
    afterwards (control: a shutdown on loopback is obeyed, tested with the
    engine's own client elsewhere)."""
    async with relay_for(engine) as (_, port):
        client, pool = remote(port)
        with pytest.raises(EngineRequestError, match="may not send 'shutdown'"):
            await client.shutdown()
        with pytest.raises(EngineRequestError, match="may not send 'configure'"):
            await client.configure(LiveConfig(devices=[]))
        # A shutdown frame cut in pieces across DATA frames: refused too.
        link = await pool.link(client.peer)
        frame = ShutdownRequest().encoded()
        reader, writer = link.open("e1", frame[:5])
        writer.write(frame[5:])
        refusal = decode_message(await read_frame(reader))
        assert refusal["code"] == "unauthorized", refusal
        assert (await client.generate(GenerateRequest(model=SMOL, **GREEDY))).text
        pool.close()
    assert (await engine.aclient().ping()).status == "ok"


async def test_a_link_carries_tokenize_detokenize_and_rerank(engine):
    """Tokenize, detokenize and rerank are inference reads: a link carries
    them to the engine, which answers them (a rerank of a chat model with
    its own refusal, bad_request, not the link's unauthorized)."""
    async with relay_for(engine) as (_, port):
        client, pool = remote(port)
        tokens = await client.tokenize(TokenizeRequest(model=SMOL, prompt="a ship"))
        assert tokens.count == len(tokens.tokens) > 0
        text = await client.detokenize(SMOL, tokens.tokens)
        assert text.text == "a ship"
        with pytest.raises(EngineRequestError) as refused:
            await client.rerank(SMOL, "q", ["d"])
        assert refused.value.code == "bad_request", refused.value
        pool.close()


async def test_a_link_holds_a_bounded_number_of_streams_and_bytes(engine):
    """Streams whose requests never finish: the link carries
    MAX_STREAMS_PER_LINK (the next is answered unreachable: the caller tries
    another replica); a request announced over MAX_LINK_REQUEST_BYTES is
    refused from its header; more than MAX_LINK_HELD_BYTES held drops the
    link; so does a stream id opened twice."""
    async with relay_for(engine) as (relay, port):
        client, pool = remote(port)
        link = await pool.link(client.peer)
        unfinished = HEADER.pack(100) + b"{"
        streams = [link.open("e1", unfinished) for _ in range(MAX_STREAMS_PER_LINK)]
        reader, _ = link.open("e1", unfinished)
        refusal = decode_message(await read_frame(reader))
        assert refusal["code"] == "unreachable", refusal
        assert "at most" in refusal["message"]
        for _, writer in streams:
            writer.close()
        reader, _ = link.open("e1", HEADER.pack(MAX_LINK_REQUEST_BYTES + 1))
        refusal = decode_message(await read_frame(reader))
        assert refusal["code"] == "unauthorized" and "cap" in refusal["message"]
        # Three requests of 30 MiB that never end: over the link's cap.
        big = MAX_LINK_HELD_BYTES // 2 - 2 * 1024 * 1024
        with contextlib.suppress(ConnectionError):  # dropped while sending
            for _ in range(3):
                _, writer = link.open("e1", HEADER.pack(big + 1) + b"x" * big)
                await writer.drain()
        await await_for(lambda: link.lost is not None, what="the link dropped")
        assert (await client.ping()).status == "ok"  # a new link
        link = await pool.link(client.peer)
        link.send(link_frame(7, OPEN, b"e1") + link_frame(7, OPEN, b"e1"))
        await await_for(lambda: link.lost is not None, what="the link dropped")
        pool.close()


async def test_stream_ids_wrap_past_the_largest_and_skip_open_ones(engine):
    """Ids are u32: after MAX_STREAM_ID the next is 1, or the next not open
    (control: a counter that does not wrap cannot pack 2^32)."""
    async with relay_for(engine) as (_, port):
        client, pool = remote(port)
        link = await pool.link(client.peer)
        held = link.open("e1", b"")  # stream 1, left open
        link._last_id = MAX_STREAM_ID - 1
        for _ in range(2):
            assert (await client.ping()).status == "ok"
        assert link._last_id == 2  # MAX_STREAM_ID, then 2 (1 is open)
        held[1].close()
        pool.close()


# -- who is still a node (points 8, 10) ------------------------------------------------


async def test_links_of_a_node_that_is_no_longer_the_one_that_opened_them_close(
    engine,
):
    """recheck: a node with the same secret keeps its link; one joined again
    (another secret) or gone loses it."""
    async with relay_for(engine) as (relay, port):
        client, pool = remote(port)
        assert (await client.ping()).status == "ok"
        relay.recheck({"a": link_proof(SECRET)})
        assert relay.links_of("a") == 1  # control: the same node stays
        relay.recheck({"a": link_proof("a new secret")})
        await await_for(lambda: relay.links_of("a") == 0, what="the link closed")
        assert (await client.ping()).status == "ok"  # it links again
        relay.recheck({})
        await await_for(lambda: relay.links_of("a") == 0, what="the link closed")
        pool.close()


async def test_a_node_with_tls_never_sends_its_secret_in_clear_text():
    """A peer with no pinned certificate is refused before connecting when
    this node's links use TLS (control: a plain-TCP cluster's pool sends its
    hello, secret and all, to the same address)."""
    hellos: list[bytes] = []

    async def listener(reader, writer):
        with contextlib.suppress(Exception):
            hellos.append(await read_frame(reader))
        writer.close()

    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    peer = Peer(node="b", host="127.0.0.1", port=port, tls_fingerprint="")
    try:
        with pytest.raises(LinkRefused, match="no TLS certificate"):
            await LinkPool(node="a", secret=SECRET).link(peer)
        assert hellos == []
        with pytest.raises((LinkRefused, OSError)):
            await LinkPool(node="a", secret=SECRET, plain_tcp=True).link(peer)
        await await_for(lambda: hellos, what="the plain hello")
        assert SECRET.encode() in hellos[0]
    finally:
        server.close()


# -- a node that cannot confirm its place (issue 31, points 11, 12) -----------------


async def test_a_relays_pong_says_whether_its_node_reaches_the_database(engine):
    """The caller's Link.peer_database follows what the relay's node says in
    each PONG: unknown before the first, then False while the node does not
    reach the database, True once it does (control: the same link, the
    answer flipped)."""
    reaches = {"database": False}
    async with relay_for(engine, database=lambda: reaches["database"]) as (_, port):
        pool = LinkPool(node="a", secret=SECRET, plain_tcp=True)
        link = await pool.link(Peer(node="b", host="127.0.0.1", port=port))
        await await_for(
            lambda: link.peer_database is False,
            timeout=30,
            what="a PONG saying 'unreached'",
        )
        assert link.alive
        reaches["database"] = True
        await await_for(
            lambda: link.peer_database is True,
            timeout=30,
            what="a PONG saying 'reached'",
        )
        pool.close()


async def test_a_node_not_serving_still_welcomes_links_but_refuses_streams(engine):
    """A node that cannot confirm its place welcomes a peer's link (its
    PONGs tell the peer whether it reaches the database) but answers a stream
    on it `unreachable` with its reason, never reaching the engine. Control:
    the same link, once the node serves again, carries the stream."""
    why = {"refusal": "node b cannot confirm its place in the cluster"}
    async with relay_for(engine, serving=lambda: why["refusal"]) as (relay, port):
        client, pool = remote(port)
        link = await pool.link(client.peer)  # welcomed: no LinkRefused
        assert relay.links_of("a") == 1
        with pytest.raises(EngineUnreachable, match="cannot confirm its place"):
            await client.ping()
        assert relay.links_of("a") == 1 and link.lost is None
        why["refusal"] = None
        assert (await client.ping()).status == "ok"
        assert await pool.link(client.peer) is link  # the same link
        pool.close()
