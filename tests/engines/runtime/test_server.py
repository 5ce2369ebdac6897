"""A real engine process on loopback serving the bundled MiniLM embedder."""

import asyncio
import contextlib
import errno
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from engines.launch.environment import THERMAL_FILE_ENV
from engines.wire.bounds import MAX_AUTH_FRAME_BYTES, MAX_FRAME_BYTES
from engines.wire.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    EngineUnauthorized,
    EngineUnreachable,
)
from engines.wire.framing import (
    HEADER,
    auth_frame,
    decode_message,
    encode_message,
)
from tests.engines.conftest import EMBEDDER, embedder_spec, start_engine
from tests.engines.raw import raw_exchange
from tests.waiting import wait_for

UNAUTHORIZED = {
    "status": "error",
    "code": "unauthorized",
    "message": "missing or wrong token",
}


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the peer sent before closing (or resetting: it closed with our
    bytes unread) the connection within `seconds`; None if it did not."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    received = b""
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return received
            received += chunk
    except ConnectionResetError:
        return received
    except TimeoutError:
        return None
    return None


class WatchPasses:
    """The engine's temperature file as a named pipe: each pass of its watch
    that reads temperatures blocks until the test hands it a reading, so the
    test knows where the passes are without asking the engine anything (a
    request would wake it). ROUNDHOUSE_THERMAL_FILE names it to the engine."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path

    def _writer(self) -> int | None:
        """A write end, once a reader has the pipe open (None before)."""
        try:
            return os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno == errno.ENXIO:
                return None
            raise

    def _no_reader(self) -> bool:
        fd = self._writer()
        if fd is None:
            return True
        os.close(fd)  # a reader still there reads to the end: no reading
        return False

    def hand(self, reading: dict) -> None:
        """Wait for the next read (the one before it over) and hand it `reading`."""
        wait_for(self._no_reader, interval=0.01, what="the last read to end")
        fd = wait_for(
            lambda: (fd := self._writer()) is not None and fd + 1,
            interval=0.01,
            what="the watch to read its temperatures",
        )
        with os.fdopen(fd - 1, "w") as pipe:
            pipe.write(json.dumps(reading))

    @contextlib.contextmanager
    def released(self):
        """Hand every read nothing meanwhile: a stopping engine's watch may be
        blocked in the pipe (its thread would hold the exit up)."""
        stop = threading.Event()

        def release() -> None:
            while not stop.wait(0.05):
                self._no_reader()

        thread = threading.Thread(target=release, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def wakeups(pid: int) -> int:
    """How many times the process's threads have been switched to, so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread has ended
            continue
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt")):
                total += int(line.split()[1])
    return total


def wakeups_per_pass(pid: int, passes: WatchPasses, *, count: int = 3) -> float:
    """The process's wake-ups between reads of its temperature file, averaged
    over `count` reads (one every pass or two of an engine's watch, which
    passes about once a second)."""
    passes.hand({"cpu": 50})
    before = wakeups(pid)
    for _ in range(count):
        passes.hand({"cpu": 50})
    return (wakeups(pid) - before) / count


# An idle engine wakes a handful of times per read of its temperatures (its
# watch's timer, the thread that reads the file); a loop polling every 10 ms
# would wake a hundred times.
IDLE_WAKEUPS_PER_READ = 40

# The control: a process that reads its temperature file as the watch does,
# and polls every 10 ms in between.
POLLER = """
import sys, time
while True:
    open(sys.argv[1]).read()
    for _ in range(100):
        time.sleep(0.01)
"""


def refused(sent: bytes | None) -> bool:
    """Whether a connection was closed, after an unauthorized answer if that
    reached us before the reset."""
    if sent is None:
        return False
    return not sent or decode_message(sent[HEADER.size :]) == UNAUTHORIZED


def test_embed_round_trip_matches_in_process_encoding(embed_engine, reference_embedder):
    """Rows from the engine equal encoding the same texts in this process."""
    texts = ["The quick brown fox", "jumps over the lazy dog", "naïve café ☕"]
    rows = embed_engine.client().embed(EMBEDDER, texts)
    expected = reference_embedder.encode(texts, convert_to_numpy=True)
    assert rows.shape == (3, 384) and rows.dtype == np.float32
    np.testing.assert_allclose(rows, expected, atol=1e-5)

    as_json = embed_engine.client().embed(EMBEDDER, texts, encoding="json")
    np.testing.assert_allclose(as_json, rows, atol=1e-6)


def test_concurrent_callers_each_get_their_own_rows(embed_engine, reference_embedder):
    """64 concurrent callers with different texts: each gets exactly its own
    vectors, and the engine served them in shared batches."""
    texts = [f"caller {i} asks about topic {i * 7 % 13}" for i in range(64)]
    # Some callers send two texts, to check slicing of uneven requests.
    requests = [
        [text] if i % 3 else [text, text.upper()] for i, text in enumerate(texts)
    ]
    before = embed_engine.client().state().models[0].batches

    async def everyone():
        client = embed_engine.aclient()
        return await asyncio.gather(*(client.embed(EMBEDDER, r) for r in requests))

    results = asyncio.run(everyone())
    for request, rows in zip(requests, results, strict=True):
        expected = reference_embedder.encode(request, convert_to_numpy=True)
        np.testing.assert_allclose(rows, expected, atol=1e-5)
    state = embed_engine.client().state().models[0]
    assert state.batches - before < len(requests)
    assert state.largest_batch > 1


def test_unknown_model(embed_engine):
    """A model the engine was not given is `unknown_model`."""
    with pytest.raises(EngineRequestError) as error:
        embed_engine.client().embed("no-such-model", ["x"])
    assert error.value.code == "unknown_model"


@pytest.mark.parametrize(
    "token",
    [None, "", "wrong", "short", "0" * 64, 12345, ["list"]],
    ids=["missing", "empty", "wrong", "short", "same-length", "number", "list"],
)
def test_bad_tokens_are_unauthorized(embed_engine, token):
    """A connection whose auth frame lacks the exact token is refused as
    unauthorized, and the request after it is not answered."""
    auth = {"kind": "auth"}
    if token is not None:
        auth["token"] = token
    data = encode_message(auth) + encode_message({"kind": "ping"})
    assert raw_exchange(embed_engine.port, data) == UNAUTHORIZED
    with pytest.raises(EngineUnauthorized):
        EngineClient(port=embed_engine.port, token="wrong").ping()


@pytest.mark.parametrize(
    "first",
    [
        {"kind": "ping", "token": "see-fixture"},  # the old shape: no auth frame
        {"kind": "auth", "token": "see-fixture", "extra": 1},
    ],
    ids=["request-first", "unknown-key"],
)
def test_a_connection_must_open_with_an_auth_frame(embed_engine, first):
    """The right token outside an auth frame of the exact shape is refused."""
    first = {**first, "token": embed_engine.token}
    assert raw_exchange(embed_engine.port, encode_message(first)) == UNAUTHORIZED


def test_an_unauthenticated_connection_never_gets_a_large_frame_read(embed_engine):
    """A first frame announcing 60 MiB is refused from its header, with only
    a few KiB of its body sent: the engine answers unauthorized and closes
    the connection without waiting for the rest (nor allocating it). After
    a wrong token, a large frame is not read either."""
    process = psutil.Process(embed_engine.process.pid)
    before = process.memory_info().rss
    port = embed_engine.port
    huge = struct.pack(">Q", 60 * 2**20) + b"x" * 4096
    for opening in (huge, auth_frame("wrong") + huge):
        with socket.create_connection(("127.0.0.1", port), 5) as sock:
            sock.sendall(opening)
            assert refused(closed_within(sock, 10))
    assert process.memory_info().rss - before < 8 * 2**20
    assert f"exceeds the {MAX_AUTH_FRAME_BYTES} cap" in embed_engine.log()
    assert embed_engine.client().ping().status == "ok"


def test_an_authenticated_connection_sends_large_frames(embed_engine):
    """With the right token, a request far over the auth frame's cap (a
    megabyte of texts) is read and answered (the control of the test above)."""
    texts = [f"text {i} " + "word " * 2200 for i in range(100)]
    message = {"kind": "embed", "model": EMBEDDER, "texts": texts, "encoding": "json"}
    data = auth_frame(embed_engine.token) + encode_message(message)
    assert len(data) > 2**20
    reply = raw_exchange(embed_engine.port, data, timeout=120)
    assert reply["status"] == "ok" and reply["shape"] == [100, 384]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"{not json", "malformed JSON"),
        (b"\xff\xfe", "malformed JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
    ],
)
def test_malformed_frames_are_bad_requests(embed_engine, payload, needle):
    """Undecodable payloads get `bad_request`; the engine keeps serving."""
    data = auth_frame(embed_engine.token) + HEADER.pack(len(payload)) + payload
    reply = raw_exchange(embed_engine.port, data)
    assert reply["code"] == "bad_request" and needle in reply["message"]
    assert embed_engine.client().ping().status == "ok"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"kind": 7}, "wrong type"),
        ({"kind": "teleport"}, "unknown kind"),
        ({"kind": "embed", "model": EMBEDDER}, "missing field 'texts'"),
        ({"kind": "embed", "model": EMBEDDER, "texts": "hello"}, "wrong type"),
        ({"kind": "embed", "model": EMBEDDER, "texts": [1, 2]}, "wrong type"),
        ({"kind": "embed", "model": EMBEDDER, "texts": []}, "empty"),
        ({"kind": "embed", "model": 3, "texts": ["x"]}, "wrong type"),
        ({"kind": "embed", "model": EMBEDDER, "texts": ["x"] * 10_001}, "cap"),
        ({"kind": "embed", "model": EMBEDDER, "texts": ["x" * 300_000]}, "cap"),
        ({"kind": "configure", "config": []}, "wrong type"),
        ({"kind": "configure", "config": {"models": [{}]}}, "config.models.0.name"),
    ],
)
def test_wrong_types_are_bad_requests(embed_engine, fields, needle):
    """Authenticated requests of the wrong shape get `bad_request`."""
    data = auth_frame(embed_engine.token) + encode_message(fields)
    reply = raw_exchange(embed_engine.port, data)
    assert reply["code"] == "bad_request"
    assert needle in reply["message"]
    assert embed_engine.client().ping().status == "ok"


def test_oversized_header_closes_the_connection_unread(embed_engine):
    """A header announcing more than the cap closes the connection at once, and
    the engine allocates nothing for it."""
    process = psutil.Process(embed_engine.process.pid)
    before = process.memory_info().rss
    for size in (MAX_FRAME_BYTES + 1, 2**40, 2**64 - 1):
        with socket.create_connection(("127.0.0.1", embed_engine.port), 5) as sock:
            sock.sendall(auth_frame(embed_engine.token) + struct.pack(">Q", size))
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed, no reply
    after = process.memory_info().rss
    assert after - before < 8 * 2**20
    assert embed_engine.client().ping().status == "ok"
    assert "exceeds the" in embed_engine.log()


def test_engine_listens_on_loopback_only(embed_engine):
    """Every listening socket of the engine is on 127.0.0.1, although its
    configuration asked for 0.0.0.0."""
    process = psutil.Process(embed_engine.process.pid)
    listening = [c for c in process.net_connections("inet") if c.status == "LISTEN"]
    assert listening
    assert {conn.laddr.ip for conn in listening} == {"127.0.0.1"}
    assert {conn.laddr.port for conn in listening} == {embed_engine.port}


def test_engine_binds_before_loading(tmp_path):
    """The port answers while the preloaded model is still loading, so a prober
    never sees it free and starts a second engine."""
    engine = start_engine(
        tmp_path, models=[embedder_spec()], preload=[EMBEDDER], wait_ready=False
    )
    phases = []

    def ready() -> bool:
        try:
            phases.append(engine.client().state().phase)
        except EngineError:
            assert engine.process.poll() is None, engine.log()
        return "ready" in phases

    try:
        wait_for(ready, what="the engine ready")
    finally:
        engine.stop()
    assert phases[0] == "loading"
    assert phases[-1] == "ready"


def test_an_idle_engine_wakes_only_for_its_watch(tmp_path, monkeypatch):
    """An idle engine sleeps on events: between two reads of its temperatures
    its threads wake a few times in all (a polling loop would wake on every
    poll: the control below)."""
    passes = WatchPasses(tmp_path / "temperatures.json")
    monkeypatch.setenv(THERMAL_FILE_ENV, str(passes.path))
    engine = start_engine(tmp_path, models=[embedder_spec()], preload=[EMBEDDER])
    try:
        engine.client().embed(EMBEDDER, ["warm up the batch loop"])
        per_read = wakeups_per_pass(engine.process.pid, passes)
    finally:
        with passes.released():
            engine.stop()
    assert per_read <= IDLE_WAKEUPS_PER_READ, per_read


def test_a_polling_loop_wakes_far_more_often(tmp_path):
    """The control of the test above: a process that reads its temperatures
    the same way and polls every 10 ms in between is caught."""
    passes = WatchPasses(tmp_path / "temperatures.json")
    poller = subprocess.Popen([sys.executable, "-c", POLLER, str(passes.path)])
    try:
        per_read = wakeups_per_pass(poller.pid, passes)
    finally:
        poller.kill()
        poller.wait()
    assert per_read > IDLE_WAKEUPS_PER_READ, per_read


def test_full_queue_answers_overloaded_and_configure_applies_live(
    embed_engine, engine_limits
):
    """Limits pushed with `configure` apply at once: with room for one queued
    batch of one text, a burst gets `overloaded` for the excess, the rest rows."""
    client = embed_engine.client()
    engine_limits(embed_engine, queue_limit=1)
    client.call("configure", config={"models": [embedder_spec(max_batch_size=1)]})

    async def burst():
        aclient = embed_engine.aclient()
        calls = [aclient.embed(EMBEDDER, [f"text {i}"]) for i in range(30)]
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        results = asyncio.run(burst())
    finally:
        client.call("configure", config={"models": [embedder_spec()]})
    refused = [r for r in results if isinstance(r, EngineRequestError)]
    served = [r for r in results if isinstance(r, np.ndarray)]
    assert refused and all(r.code == "overloaded" for r in refused)
    assert served and all(r.shape == (1, 384) for r in served)
    assert len(refused) + len(served) == 30


def test_queue_timeout_zero_admits_embeddings_only_when_a_batch_is_free(
    embed_engine, engine_limits
):
    """Timeout 0: while a big batch runs, another request is refused at once;
    once the engine is idle, requests are served."""
    import threading

    client = embed_engine.client()
    engine_limits(embed_engine, queue_timeout_s=0)
    big = [f"sentence {i} about slots, queues and batches" for i in range(3000)]
    outcome = {}
    worker = threading.Thread(
        target=lambda: outcome.setdefault("big", client.embed(EMBEDDER, big))
    )
    try:
        worker.start()
        wait_for(
            lambda: embed_engine.client().state().models[0].busy,
            what="the big batch running",
        )
        with pytest.raises(EngineRequestError) as error:
            embed_engine.client().embed(EMBEDDER, ["one more"])
        assert error.value.code == "overloaded"
        assert "queue timeout is 0" in error.value.message
        worker.join(120)
        assert outcome["big"].shape == (3000, 384)
        assert embed_engine.client().embed(EMBEDDER, ["now idle"]).shape == (1, 384)
    finally:
        worker.join(120)


def test_client_errors_name_the_failure(embed_engine):
    """No listener: EngineUnreachable. Wrong token: EngineUnauthorized (async too)."""
    from tests.engines.conftest import free_port

    with pytest.raises(EngineUnreachable):
        EngineClient(port=free_port(), token="x").ping()

    async def wrong_token():
        from engines.wire.client import AsyncEngineClient

        await AsyncEngineClient(port=embed_engine.port, token="x").ping()

    with pytest.raises(EngineUnauthorized):
        asyncio.run(wrong_token())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_engine_runs_on_the_cores_it_is_given(tmp_path):
    """An engine given CPU cores runs on those only; one given none keeps all of
    this process's."""
    ours = sorted(os.sched_getaffinity(0))
    pinned = start_engine(tmp_path, models=[], cpus=[ours[-1]])
    free = start_engine(tmp_path, models=[])
    try:
        assert psutil.Process(pinned.process.pid).cpu_affinity() == [ours[-1]]
        assert psutil.Process(free.process.pid).cpu_affinity() == ours
    finally:
        pinned.stop()
        free.stop()


def test_engine_refuses_cores_it_cannot_have(tmp_path):
    engine = start_engine(tmp_path, models=[], cpus=[4000], wait_ready=False)
    assert engine.process.wait(60) == 2
    assert "cannot run on CPU cores [4000]" in engine.log()
