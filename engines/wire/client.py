"""Clients of an engine: asyncio for the web process, blocking for Celery, the
supervisor and scripts. Both speak engines/wire/framing.py and raise one error type
per failure."""

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engines.launch.config import LOOPBACK
from engines.wire.bounds import CONTROL_TIMEOUT_S, MAX_FRAME_BYTES
from engines.wire.errors import ErrorCode, ProtocolError
from engines.wire.framing import (
    auth_frame,
    decode_array,
    decode_message,
    encode_message,
    read_frame,
    recv_frame,
)

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
    """The engine answered with an error code (see protocol.ErrorCode)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class EngineUnauthorized(EngineRequestError):
    """The engine refused the token."""


def _raise_for_error(reply: dict[str, Any]) -> None:
    if reply.get("status") == "ok":
        return
    code = str(reply.get("code", ErrorCode.INTERNAL))
    message = str(reply.get("message", "engine error"))
    if code == ErrorCode.UNAUTHORIZED:
        raise EngineUnauthorized(code, message)
    if code == ErrorCode.UNREACHABLE:
        raise EngineUnreachable(message)
    raise EngineRequestError(code, message)


def _timeout_for(kind: str, timeout: float | None) -> float:
    if timeout is not None:
        return timeout
    return CONTROL_TIMEOUT_S if kind in CONTROL_KINDS else REQUEST_TIMEOUT_S


def _embeddings(reply: dict[str, Any], array: bytes | None) -> np.ndarray:
    if reply.get("encoding") == "json":
        return np.asarray(reply["embeddings"], dtype=np.float32)
    if array is None:
        raise EngineRequestError(ErrorCode.INTERNAL, "embedding payload missing")
    return decode_array(array)


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

    def _opening(self, message: dict[str, Any]) -> bytes:
        """What a connection sends first: its auth frame, then the request
        (one write: the engine reads the request once the token is checked)."""
        return auth_frame(self._token) + encode_message(message)

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
        self, message: dict[str, Any], *, timeout: float | None = None
    ) -> tuple[dict[str, Any], bytes | None]:
        """Send one request; returns the reply and its array payload, if any."""
        kind = str(message.get("kind", ""))
        limit = _timeout_for(kind, timeout)
        reader, writer = await self._open(message)
        try:
            await writer.drain()
            async with asyncio.timeout(limit):
                reply, array = await self._read_reply(reader)
        except TimeoutError:
            raise EngineTimeout(
                f"engine {self.name}: no answer in {limit:g} s"
            ) from None
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            raise EngineDied(
                f"engine {self.name} dropped the request: {error}"
            ) from None
        finally:
            writer.close()
        _raise_for_error(reply)
        return reply, array

    async def _open(
        self, message: dict[str, Any]
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect and send one request (see `connect_and_send`)."""
        data = self._opening(message)
        try:
            return await connect_and_send(self.port, data, timeout=CONTROL_TIMEOUT_S)
        except (OSError, TimeoutError) as error:
            raise _unreachable(self.name, error) from None

    async def _read_reply(self, reader) -> tuple[dict[str, Any], bytes | None]:
        payload = await read_frame(reader, max_bytes=MAX_FRAME_BYTES)
        if payload is None:
            raise ConnectionError("connection closed before the answer")
        reply = decode_message(payload)
        array = None
        if reply.get("encoding") == "npy":
            array = await read_frame(reader, max_bytes=MAX_FRAME_BYTES)
            if array is None:
                raise ConnectionError("connection closed before the array")
        return reply, array

    async def call(self, kind: str, **fields: Any) -> dict[str, Any]:
        reply, _ = await self.request({"kind": kind, **fields})
        return reply

    async def ping(self) -> dict[str, Any]:
        return await self.call("ping")

    async def state(self) -> dict[str, Any]:
        return await self.call("state")

    async def embed(
        self, model: str, texts: list[str], *, encoding: str = "npy"
    ) -> np.ndarray:
        rows, _ = await self.embed_counted(model, texts, encoding=encoding)
        return rows

    async def embed_counted(
        self, model: str, texts: list[str], *, encoding: str = "npy"
    ) -> tuple[np.ndarray, int]:
        """The rows and the texts' token total, as the model counted them."""
        reply, array = await self.request(
            {"kind": "embed", "model": model, "texts": texts, "encoding": encoding}
        )
        tokens = int(reply.get("usage", {}).get("prompt_tokens", 0))
        return _embeddings(reply, array), tokens

    async def generate(self, model: str, **fields: Any) -> dict[str, Any]:
        """The whole answer: text, finish_reason, usage, timings, request_id."""
        return await self.call("generate", model=model, **fields)

    async def generate_stream(
        self, model: str, *, timeout: float | None = None, **fields: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Frames as the engine decodes: start, token..., then done. Closing the
        iterator early hangs up, which cancels the request in the engine.

        `timeout`: the longest wait for the next frame. Each read runs under
        `asyncio.timeout`, not `asyncio.wait_for`, which in Python 3.11 runs
        what it awaits in a task of its own: a task and a loop pass per token."""
        limit = timeout or REQUEST_TIMEOUT_S
        message = {"kind": "generate_stream", "model": model, **fields}
        reader, writer = await self._open(message)
        try:
            await writer.drain()
            while True:
                try:
                    async with asyncio.timeout(limit):
                        payload = await read_frame(reader)
                except TimeoutError:
                    raise EngineTimeout(f"engine {self.name}: stream stalled") from None
                except (ConnectionError, OSError) as error:
                    raise EngineDied(f"engine {self.name}: {error}") from None
                if payload is None:
                    raise EngineDied(f"engine {self.name} closed the stream")
                frame = decode_message(payload)
                _raise_for_error(frame)
                yield frame
                if frame.get("event") == "done":
                    return
        finally:
            writer.close()

    async def cancel(self, request_id: str) -> bool:
        return (await self.call("cancel", request_id=request_id))["cancelled"]


# -- blocking client ----------------------------------------------------------------


class EngineClient(_EngineAddress):
    """A blocking client for Celery workers, the supervisor and scripts."""

    def request(
        self, message: dict[str, Any], *, timeout: float | None = None
    ) -> tuple[dict[str, Any], bytes | None]:
        """Send one request; returns the reply and its array payload, if any."""
        kind = str(message.get("kind", ""))
        limit = _timeout_for(kind, timeout)
        try:
            sock = socket.create_connection((LOOPBACK, self.port), CONTROL_TIMEOUT_S)
        except OSError as error:
            raise EngineUnreachable(f"engine {self.name}: {error}") from None
        with sock:
            sock.settimeout(limit)
            try:
                sock.sendall(self._opening(message))
                reply = decode_message(recv_frame(sock))
                array = recv_frame(sock) if reply.get("encoding") == "npy" else None
            except TimeoutError:
                raise EngineTimeout(
                    f"engine {self.name}: no answer in {limit:g} s"
                ) from None
            except (ConnectionError, OSError) as error:
                raise EngineDied(
                    f"engine {self.name} dropped the request: {error}"
                ) from None
            except ProtocolError as error:
                raise EngineRequestError(error.code, error.message) from None
        _raise_for_error(reply)
        return reply, array

    def call(self, kind: str, **fields: Any) -> dict[str, Any]:
        reply, _ = self.request({"kind": kind, **fields})
        return reply

    def ping(self) -> dict[str, Any]:
        return self.call("ping")

    def state(self) -> dict[str, Any]:
        return self.call("state")

    def embed(
        self, model: str, texts: list[str], *, encoding: str = "npy"
    ) -> np.ndarray:
        reply, array = self.request(
            {"kind": "embed", "model": model, "texts": texts, "encoding": encoding}
        )
        return _embeddings(reply, array)

    def generate(self, model: str, **fields: Any) -> dict[str, Any]:
        """The whole answer: text, finish_reason, usage, timings, request_id."""
        return self.call("generate", model=model, **fields)

    def generate_stream(
        self, model: str, *, timeout: float | None = None, **fields: Any
    ) -> Iterator[dict[str, Any]]:
        """Frames as the engine decodes: start, token..., then done. Closing the
        generator early hangs up, which cancels the request in the engine."""
        try:
            sock = socket.create_connection((LOOPBACK, self.port), CONTROL_TIMEOUT_S)
        except OSError as error:
            raise EngineUnreachable(f"engine {self.name}: {error}") from None
        message = {"kind": "generate_stream", "model": model, **fields}
        with sock:
            sock.settimeout(timeout or REQUEST_TIMEOUT_S)
            try:
                sock.sendall(self._opening(message))
                while True:
                    frame = decode_message(recv_frame(sock))
                    _raise_for_error(frame)
                    yield frame
                    if frame.get("event") == "done":
                        return
            except TimeoutError:
                raise EngineTimeout(f"engine {self.name}: stream stalled") from None
            except (ConnectionError, OSError) as error:
                raise EngineDied(f"engine {self.name}: {error}") from None

    def cancel(self, request_id: str) -> bool:
        return self.call("cancel", request_id=request_id)["cancelled"]
