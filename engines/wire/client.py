"""Clients of an engine: asyncio for the web process, blocking for Celery, the
supervisor and scripts. Both speak engines/wire/framing.py, send typed requests
(engines/wire/requests.py), read typed replies (engines/wire/replies.py) and
raise one error type per failure: a reply that does not match its schema is an
error (EngineReplyInvalid), never read in part."""

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
from pydantic import ValidationError

from engines.launch.config import LOOPBACK, LiveConfig
from engines.wire.bounds import CONTROL_TIMEOUT_S, MAX_FRAME_BYTES
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.framing import auth_frame, decode_array, read_frame, recv_frame
from engines.wire.replies import (
    CancelReply,
    DetokenizeReply,
    DoneFrame,
    EmbedReply,
    ErrorReply,
    Frame,
    GenerateAnswer,
    LoadReply,
    OkReply,
    PingReply,
    RerankReply,
    StartFrame,
    StateReply,
    TokenFrame,
    TokenizeReply,
    UnloadReply,
    parse_reply,
)
from engines.wire.requests import (
    CancelRequest,
    ConfigureRequest,
    DetokenizeRequest,
    EmbedRequest,
    GenerateRequest,
    LoadRequest,
    PingRequest,
    Request,
    RerankRequest,
    ShutdownRequest,
    StateRequest,
    TokenizeRequest,
    UnloadRequest,
    parse_request,
)

Encoding = Literal["json", "npy"]

# Model work (a first load, a big batch) can take a while; control frames cannot.
REQUEST_TIMEOUT_S = 120.0
CONTROL_KINDS = frozenset({"ping", "state", "configure", "shutdown", "cancel"})


class EngineError(Exception):
    """Any failure talking to an engine."""


class EngineUnreachable(EngineError):
    """Nothing answers on the engine's port (not started, or gone)."""


class EngineTimeout(EngineError):
    """The engine accepted the request but did not answer in time."""


class EngineDied(EngineError):
    """The connection dropped before the answer arrived: the engine died or was
    killed mid-request."""


class EngineRequestError(EngineError):
    """The engine answered with an error code (engines.wire.errors.ErrorCode)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = ErrorCode(code)
        self.message = message


class EngineUnauthorized(EngineRequestError):
    """The engine refused the token."""


class EngineReplyInvalid(EngineRequestError):
    """The engine answered something its reply's schema refuses (a key it
    does not know, one missing, a frame out of order): an internal error."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)


def _reply(kind: str, payload: bytes, engine: str) -> Frame:
    """The reply to a request of `kind` (a stream's: one of its frames); the
    error it answers raised."""
    try:
        reply = parse_reply(kind, payload)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise EngineReplyInvalid(
            f"engine {engine}: its {kind} reply does not match the protocol: "
            f"{where}: {first['msg']}"
        ) from None
    if isinstance(reply, ErrorReply):
        if reply.code == ErrorCode.UNAUTHORIZED:
            raise EngineUnauthorized(reply.code, reply.message)
        if reply.code == ErrorCode.UNREACHABLE:
            raise EngineUnreachable(reply.message)
        raise EngineRequestError(reply.code, reply.message)
    return reply


def _built(kind: str, fields: dict[str, Any]) -> Request:
    """The request of `kind` with these fields, checked as the engine will."""
    try:
        return parse_request({"kind": kind, **fields})
    except ProtocolError as error:
        raise EngineRequestError(error.code, error.message) from None


class _Stream:
    """The order of a stream's frames: a start, tokens, then a done."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.started = False

    def frame(self, payload: bytes) -> StartFrame | TokenFrame | DoneFrame:
        frame = _reply("generate_stream", payload, self.engine)
        if isinstance(frame, StartFrame) == self.started:
            what = "a second start" if self.started else f"a {frame.event} first"
            raise EngineReplyInvalid(f"engine {self.engine}: {what} in a stream")
        self.started = True
        return frame


def _embed_request(
    model: str, texts: list[str], encoding: Encoding, keep_alive_s: float | None
) -> EmbedRequest:
    """An embed request, built, not checked here: the caller's edge checked
    its texts (the REST schema), and the engine checks what arrives."""
    return EmbedRequest.model_construct(
        model=model, texts=texts, encoding=encoding, keep_alive_s=keep_alive_s
    )


def _rerank_request(model: str, query: str, documents: list[str]) -> RerankRequest:
    """A rerank request, built, not checked here (as _embed_request)."""
    return RerankRequest.model_construct(model=model, query=query, documents=documents)


def _detokenize_request(model: str, tokens: list[int]) -> DetokenizeRequest:
    """A detokenize request, built, not checked here (as _embed_request)."""
    return DetokenizeRequest.model_construct(model=model, tokens=tokens)


def _timeout_for(kind: str, timeout: float | None) -> float:
    if timeout is not None:
        return timeout
    return CONTROL_TIMEOUT_S if kind in CONTROL_KINDS else REQUEST_TIMEOUT_S


def _embeddings(reply: EmbedReply, array: bytes | None) -> np.ndarray:
    if reply.embeddings is not None:
        return np.asarray(reply.embeddings, dtype=np.float32)
    if array is None:
        raise EngineReplyInvalid("embedding payload missing")
    return decode_array(array)


@contextlib.contextmanager
def _translated(name: str, during: str):
    """The one translation of what reading an engine's answer can raise, for
    both clients (their reads differ only in I/O): a timeout is
    EngineTimeout, a frame over its cap (FrameTooLarge) or a malformed one
    EngineRequestError with its code, a connection that ends EngineDied.
    `during`: what the timeout means ("no answer in 120 s", "stream
    stalled")."""
    try:
        yield
    except TimeoutError:  # before OSError: it is one
        raise EngineTimeout(f"engine {name}: {during}") from None
    except ProtocolError as error:
        raise EngineRequestError(error.code, error.message) from None
    except (ConnectionError, OSError, asyncio.IncompleteReadError) as error:
        raise EngineDied(f"engine {name}: {error or type(error).__name__}") from None


def _unreachable(name: str, error: OSError | TimeoutError) -> EngineUnreachable:
    if isinstance(error, TimeoutError):
        return EngineUnreachable(
            f"engine {name}: no connection in {CONTROL_TIMEOUT_S:g} s"
        )
    return EngineUnreachable(f"engine {name}: {error}")


# -- connection files -----------------------------------------------------------


def connection_file(run_dir: Path | str, name: str) -> Path:
    """Where the supervisor leaves an engine's port and token (mode 0600)."""
    return Path(run_dir) / "engines" / f"{name}.json"


def write_connection_file(
    run_dir: Path | str,
    *,
    name: str,
    port: int,
    token: str,
    pid: int | None = None,
    pid_started_at: float | None = None,
) -> Path:
    """Write an engine's connection details readable by this user only. With
    the process's pid and start time (psutil's create_time), a later supervisor
    can prove a process left running is this engine, not a reused pid."""
    path = connection_file(run_dir, name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    info = {
        "name": name,
        "port": port,
        "token": token,
        "pid": pid,
        "pid_started_at": pid_started_at,
    }
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(info, handle)
    os.replace(partial, path)
    return path


def read_connection_file(run_dir: Path | str, name: str) -> dict[str, Any]:
    path = connection_file(run_dir, name)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineUnreachable(
            f"engine {name!r} has no connection file in {path.parent}: is the "
            "supervisor running? (manage.py supervise)"
        ) from None


# -- asyncio client -------------------------------------------------------------


class _EngineAddress:
    """Where an engine listens and the token it wants."""

    def __init__(self, *, port: int, token: str, name: str = "") -> None:
        self.port = port
        self.name = name or f"port {port}"
        self._token = token

    def _opening(self, message: Request) -> bytes:
        """What a connection sends first: its auth frame, then the request
        (one write: the engine reads the request once the token is checked)."""
        return auth_frame(self._token) + message.encoded()

    @classmethod
    def for_engine(cls, run_dir: Path | str, name: str):
        """A client for a supervised engine, from its connection file."""
        info = read_connection_file(run_dir, name)
        return cls(port=info["port"], token=info["token"], name=name)


async def connect_and_send(
    port: int, data: bytes, *, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a loopback port and send `data` (the writer may still hold its
    tail); OSError or TimeoutError if that fails.

    On loopback the kernel completes the handshake inside connect(), so the data
    is sent before this first yields to the event loop: in a burst of requests
    each leaves as soon as it is handled. Through `asyncio.open_connection` it
    would wait a loop pass for the connection, behind every other callback ready
    then (the rest of the burst). When the handshake is not done at once (a full
    listen queue), this waits for it, up to `timeout`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.connect_ex((LOOPBACK, port))
        sent = sock.send(data)
    except BlockingIOError:
        sock.close()
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(data)
        return reader, writer
    except OSError:
        sock.close()
        raise
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise
    if sent < len(data):
        writer.write(data[sent:])
    return reader, writer


class AsyncEngineClient(_EngineAddress):
    """An asyncio client: one short connection per request."""

    async def request(
        self, message: Request, *, timeout: float | None = None
    ) -> tuple[Frame, bytes | None]:
        """Send one request; returns its reply and its array payload, if any."""
        limit = _timeout_for(message.kind, timeout)
        reader, writer = await self._open(message)
        try:
            with _translated(self.name, f"no answer in {limit:g} s"):
                await writer.drain()
                async with asyncio.timeout(limit):
                    return await self._read_reply(reader, message.kind)
        finally:
            writer.close()

    async def _open(
        self, message: Request
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect and send one request (see `connect_and_send`)."""
        data = self._opening(message)
        try:
            return await connect_and_send(self.port, data, timeout=CONTROL_TIMEOUT_S)
        except (OSError, TimeoutError) as error:
            raise _unreachable(self.name, error) from None

    async def _read_reply(self, reader, kind: str) -> tuple[Frame, bytes | None]:
        payload = await read_frame(reader, max_bytes=MAX_FRAME_BYTES)
        if payload is None:
            raise ConnectionError("connection closed before the answer")
        reply = _reply(kind, payload, self.name)
        array = None
        if isinstance(reply, EmbedReply) and reply.encoding == "npy":
            array = await read_frame(reader, max_bytes=MAX_FRAME_BYTES)
            if array is None:
                raise ConnectionError("connection closed before the array")
        return reply, array

    async def call(self, kind: str, **fields: Any) -> Frame:
        """The request of `kind` built from `fields` (refused here as the
        engine would refuse it), sent; its reply."""
        reply, _ = await self.request(_built(kind, fields))
        return reply

    async def ping(self) -> PingReply:
        reply, _ = await self.request(PingRequest())
        return cast(PingReply, reply)

    async def state(self) -> StateReply:
        reply, _ = await self.request(StateRequest())
        return cast(StateReply, reply)

    async def load(
        self,
        model: str,
        *,
        keep_alive_s: float | None = None,
        timeout: float | None = None,
    ) -> LoadReply:
        request = LoadRequest(model=model, keep_alive_s=keep_alive_s)
        reply, _ = await self.request(request, timeout=timeout)
        return cast(LoadReply, reply)

    async def unload(
        self, model: str, *, when_idle: bool = False, timeout: float | None = None
    ) -> UnloadReply:
        request = UnloadRequest(model=model, when_idle=when_idle)
        reply, _ = await self.request(request, timeout=timeout)
        return cast(UnloadReply, reply)

    async def embed(
        self, model: str, texts: list[str], *, encoding: Encoding = "npy"
    ) -> np.ndarray:
        rows, _ = await self.embed_counted(model, texts, encoding=encoding)
        return rows

    async def embed_counted(
        self,
        model: str,
        texts: list[str],
        *,
        encoding: Encoding = "npy",
        keep_alive_s: float | None = None,
    ) -> tuple[np.ndarray, EmbedReply]:
        """The rows and the reply's header: the texts' token total, as the
        model counted them, and the wait for its load."""
        message = _embed_request(model, texts, encoding, keep_alive_s)
        reply, array = await self.request(message)
        header = cast(EmbedReply, reply)
        return _embeddings(header, array), header

    async def rerank(self, model: str, query: str, documents: list[str]) -> RerankReply:
        """Each document's relevance to the query, in their order."""
        reply, _ = await self.request(_rerank_request(model, query, documents))
        return cast(RerankReply, reply)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeReply:
        """The prompt's tokens as a generation of it would evaluate them."""
        reply, _ = await self.request(request)
        return cast(TokenizeReply, reply)

    async def detokenize(self, model: str, tokens: list[int]) -> DetokenizeReply:
        reply, _ = await self.request(_detokenize_request(model, tokens))
        return cast(DetokenizeReply, reply)

    async def generate(self, request: GenerateRequest) -> GenerateAnswer:
        """The whole answer: text, finish_reason, usage, timings, request_id."""
        reply, _ = await self.request(request.model_copy(update={"kind": "generate"}))
        return cast(GenerateAnswer, reply)

    async def generate_stream(
        self, request: GenerateRequest, *, timeout: float | None = None
    ) -> AsyncIterator[StartFrame | TokenFrame | DoneFrame]:
        """Frames as the engine decodes: start, token..., then done. Closing the
        iterator early hangs up, which cancels the request in the engine.

        `timeout`: the longest wait for the next frame. Each read runs under
        `asyncio.timeout`, not `asyncio.wait_for`, which in Python 3.11 runs
        what it awaits in a task of its own: a task and a loop pass per token."""
        limit = timeout or REQUEST_TIMEOUT_S
        message = request.model_copy(update={"kind": "generate_stream"})
        reader, writer = await self._open(message)
        order = _Stream(self.name)
        try:
            with _translated(self.name, "stream stalled"):
                await writer.drain()
            while True:
                with _translated(self.name, "stream stalled"):
                    async with asyncio.timeout(limit):
                        payload = await read_frame(reader)
                if payload is None:
                    raise EngineDied(f"engine {self.name} closed the stream")
                frame = order.frame(payload)
                yield frame
                if isinstance(frame, DoneFrame):
                    return
        finally:
            writer.close()

    async def cancel(self, request_id: str) -> bool:
        reply, _ = await self.request(CancelRequest(request_id=request_id))
        return cast(CancelReply, reply).cancelled

    async def configure(self, config: LiveConfig) -> OkReply:
        reply, _ = await self.request(ConfigureRequest(config=config))
        return cast(OkReply, reply)

    async def shutdown(self) -> OkReply:
        reply, _ = await self.request(ShutdownRequest())
        return cast(OkReply, reply)


# -- blocking client ----------------------------------------------------------------


class EngineClient(_EngineAddress):
    """A blocking client for Celery workers, the supervisor and scripts."""

    def request(
        self, message: Request, *, timeout: float | None = None
    ) -> tuple[Frame, bytes | None]:
        """Send one request; returns its reply and its array payload, if any."""
        limit = _timeout_for(message.kind, timeout)
        try:
            sock = socket.create_connection((LOOPBACK, self.port), CONTROL_TIMEOUT_S)
        except OSError as error:
            raise EngineUnreachable(f"engine {self.name}: {error}") from None
        with sock, _translated(self.name, f"no answer in {limit:g} s"):
            sock.settimeout(limit)
            sock.sendall(self._opening(message))
            reply = _reply(message.kind, recv_frame(sock), self.name)
            array = None
            if isinstance(reply, EmbedReply) and reply.encoding == "npy":
                array = recv_frame(sock)
        return reply, array

    def call(self, kind: str, **fields: Any) -> Frame:
        """The request of `kind` built from `fields` (refused here as the
        engine would refuse it), sent; its reply."""
        reply, _ = self.request(_built(kind, fields))
        return reply

    def ping(self) -> PingReply:
        reply, _ = self.request(PingRequest())
        return cast(PingReply, reply)

    def state(self) -> StateReply:
        reply, _ = self.request(StateRequest())
        return cast(StateReply, reply)

    def load(
        self,
        model: str,
        *,
        keep_alive_s: float | None = None,
        timeout: float | None = None,
    ) -> LoadReply:
        request = LoadRequest(model=model, keep_alive_s=keep_alive_s)
        reply, _ = self.request(request, timeout=timeout)
        return cast(LoadReply, reply)

    def unload(
        self, model: str, *, when_idle: bool = False, timeout: float | None = None
    ) -> UnloadReply:
        request = UnloadRequest(model=model, when_idle=when_idle)
        reply, _ = self.request(request, timeout=timeout)
        return cast(UnloadReply, reply)

    def embed(
        self, model: str, texts: list[str], *, encoding: Encoding = "npy"
    ) -> np.ndarray:
        rows, _ = self.embed_counted(model, texts, encoding=encoding)
        return rows

    def embed_counted(
        self,
        model: str,
        texts: list[str],
        *,
        encoding: Encoding = "npy",
        keep_alive_s: float | None = None,
    ) -> tuple[np.ndarray, EmbedReply]:
        """The rows and the reply's header: the texts' token total, as the
        model counted them, and the wait for its load."""
        message = _embed_request(model, texts, encoding, keep_alive_s)
        reply, array = self.request(message)
        header = cast(EmbedReply, reply)
        return _embeddings(header, array), header

    def rerank(self, model: str, query: str, documents: list[str]) -> RerankReply:
        """Each document's relevance to the query, in their order."""
        reply, _ = self.request(_rerank_request(model, query, documents))
        return cast(RerankReply, reply)

    def tokenize(self, request: TokenizeRequest) -> TokenizeReply:
        """The prompt's tokens as a generation of it would evaluate them."""
        reply, _ = self.request(request)
        return cast(TokenizeReply, reply)

    def detokenize(self, model: str, tokens: list[int]) -> DetokenizeReply:
        reply, _ = self.request(_detokenize_request(model, tokens))
        return cast(DetokenizeReply, reply)

    def generate(self, request: GenerateRequest) -> GenerateAnswer:
        """The whole answer: text, finish_reason, usage, timings, request_id."""
        reply, _ = self.request(request.model_copy(update={"kind": "generate"}))
        return cast(GenerateAnswer, reply)

    def generate_stream(
        self, request: GenerateRequest, *, timeout: float | None = None
    ) -> Iterator[StartFrame | TokenFrame | DoneFrame]:
        """Frames as the engine decodes: start, token..., then done. Closing the
        generator early hangs up, which cancels the request in the engine."""
        try:
            sock = socket.create_connection((LOOPBACK, self.port), CONTROL_TIMEOUT_S)
        except OSError as error:
            raise EngineUnreachable(f"engine {self.name}: {error}") from None
        message = request.model_copy(update={"kind": "generate_stream"})
        order = _Stream(self.name)
        with sock:
            sock.settimeout(timeout or REQUEST_TIMEOUT_S)
            with _translated(self.name, "stream stalled"):
                sock.sendall(self._opening(message))
            while True:
                with _translated(self.name, "stream stalled"):
                    payload = recv_frame(sock)
                frame = order.frame(payload)
                yield frame
                if isinstance(frame, DoneFrame):
                    return

    def cancel(self, request_id: str) -> bool:
        reply, _ = self.request(CancelRequest(request_id=request_id))
        return cast(CancelReply, reply).cancelled

    def configure(self, config: LiveConfig) -> OkReply:
        reply, _ = self.request(ConfigureRequest(config=config))
        return cast(OkReply, reply)

    def shutdown(self) -> OkReply:
        reply, _ = self.request(ShutdownRequest())
        return cast(OkReply, reply)
