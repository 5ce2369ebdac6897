"""The engine process's server: one asyncio loop serving framed requests from any
number of connections, with the models resident in this process."""

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from .batching import MicroBatcher
from .config import LOOPBACK, EngineConfig, Limits, ModelSpec
from .protocol import (
    MAX_FRAME_BYTES,
    ErrorCode,
    FrameTooLarge,
    ProtocolError,
    decode_message,
    encode_array,
    encode_message,
    error_frame,
    frame_bytes,
    read_frame,
    validate_request,
)

log = logging.getLogger("roundhouse.engine")

# How long `shutdown` waits for requests in flight before closing anyway.
DRAIN_TIMEOUT_S = 30.0

Reply = tuple[dict[str, Any], bytes | None]


@dataclass
class ResidentModel:
    """A model loaded in this engine, with its batcher and measured memory."""

    spec: ModelSpec
    backend: Any
    batcher: MicroBatcher
    executor: ThreadPoolExecutor
    memory_mib: float
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "format": self.spec.format,
            "memory_mib": round(self.memory_mib, 1),
            "loaded_at": self.loaded_at,
            "idle_s": round(time.monotonic() - self.last_used, 1),
            "queued": self.batcher.queued_requests,
            "batches": self.batcher.stats.batches,
            "batched_items": self.batcher.stats.items,
            "largest_batch": self.batcher.stats.largest,
        }


def _load_backend(spec: ModelSpec, backend: str):
    """Construct a model backend (imports the ML library on first use)."""
    if spec.format == "embedding":
        from .backends.embedding import EmbeddingBackend

        return EmbeddingBackend(
            spec.path, backend=backend, batch_size=spec.max_batch_size
        )
    raise ProtocolError(
        ErrorCode.BAD_REQUEST,
        f"model {spec.name!r} has format {spec.format!r}, which this engine "
        "version does not serve yet",
    )


class EngineServer:
    """Serves one engine's models over the framed protocol on loopback."""

    def __init__(self, config: EngineConfig, token: str) -> None:
        if not token:
            raise ValueError("an engine needs a token")
        self.config = config
        self._token = token.encode("utf-8")
        self.models: dict[str, ResidentModel] = {}
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._loading: set[str] = set()
        self._server: asyncio.Server | None = None
        self._stop = asyncio.Event()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.started_at = time.time()
        self.port: int | None = None

    # -- lifecycle ------------------------------------------------------------

    async def startup(self) -> None:
        """Bind first (a prober sees the port taken at once), then load models."""
        # Loopback only, whatever any setting says.
        self._server = await asyncio.start_server(
            self._serve_connection, host=LOOPBACK, port=self.config.port, backlog=4096
        )
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("engine %s listening on %s:%s", self.config.name, LOOPBACK, self.port)
        for name in self.config.preload:
            try:
                await self.ensure_loaded(name)
            except ProtocolError as error:
                log.error("preloading %s failed: %s", name, error.message)

    async def run(self) -> None:
        """Serve until asked to stop, then drain."""
        await self.startup()
        await self._stop.wait()
        await self.shutdown()

    def request_stop(self) -> None:
        self._stop.set()

    async def shutdown(self) -> None:
        """Stop accepting, let requests in flight finish, close everything."""
        if self._server is not None:
            self._server.close()
        try:
            await asyncio.wait_for(self._idle.wait(), DRAIN_TIMEOUT_S)
        except TimeoutError:
            log.warning("drain timed out with %d requests in flight", self._inflight)
        for writer in list(self._writers):
            writer.close()
        for model in list(self.models.values()):
            await self._unload(model)
        log.info("engine %s stopped", self.config.name)

    # -- connections ----------------------------------------------------------

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._writers.add(writer)
        try:
            while not self._stop.is_set():
                try:
                    payload = await read_frame(reader, max_bytes=MAX_FRAME_BYTES)
                except FrameTooLarge as error:
                    # Close at once: the oversized payload is never read or stored.
                    log.warning("closing a connection: %s", error.message)
                    return
                except (ConnectionError, OSError):
                    return
                if payload is None:
                    return
                await self._answer(payload, writer)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, payload: bytes, writer: asyncio.StreamWriter) -> None:
        self._inflight += 1
        self._idle.clear()
        after: Callable[[], None] | None = None
        try:
            try:
                message = decode_message(payload)
                self._authenticate(message)
                kind = validate_request(message)
                handler: Callable[[dict], Awaitable[Reply]] = getattr(
                    self, f"handle_{kind}"
                )
                reply, array = await handler(message)
                if kind == "shutdown":
                    after = self.request_stop
            except ProtocolError as error:
                reply, array = error.as_frame(), None
            except Exception:
                log.exception("request failed")
                reply, array = error_frame(ErrorCode.INTERNAL, "internal error"), None
            data = encode_message(reply)
            if array is not None:
                data += frame_bytes(array)
            writer.write(data)
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the caller went away; nothing to tell it
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
            if after is not None:
                after()

    def _authenticate(self, message: dict[str, Any]) -> None:
        token = message.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(
            token.encode("utf-8"), self._token
        ):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong token")

    # -- models ---------------------------------------------------------------

    @property
    def phase(self) -> str:
        return "loading" if self._loading else "ready"

    async def ensure_loaded(self, name: str) -> ResidentModel:
        """The resident model, loading it first (once, whoever asks) if needed."""
        model = self.models.get(name)
        if model is not None:
            return model
        spec = self.config.models.get(name)
        if spec is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_MODEL, f"model {name!r} is not configured here"
            )
        lock = self._load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name in self.models:
                return self.models[name]
            self._loading.add(name)
            try:
                return await self._load(spec)
            finally:
                self._loading.discard(name)

    async def _load(self, spec: ModelSpec) -> ResidentModel:
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{spec.name}")
        process = psutil.Process()
        before = process.memory_info().rss
        log.info("loading %s from %s", spec.name, spec.path)
        try:
            backend = await loop.run_in_executor(
                executor, _load_backend, spec, self.config.backend
            )
        except ProtocolError:
            executor.shutdown(wait=False)
            raise
        except Exception as error:
            executor.shutdown(wait=False)
            log.exception("loading %s failed", spec.name)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"loading {spec.name!r} failed: {error}"
            ) from error
        memory_mib = max(process.memory_info().rss - before, 0) / 2**20
        batcher = MicroBatcher(
            backend.encode,
            executor=executor,
            window_s=spec.batch_window_ms / 1000,
            max_batch_size=spec.max_batch_size,
            queue_timeout_s=self.config.limits.queue_timeout_s,
        )
        model = ResidentModel(spec, backend, batcher, executor, memory_mib)
        self.models[spec.name] = model
        log.info("loaded %s (%.0f MiB)", spec.name, memory_mib)
        return model

    async def _unload(self, model: ResidentModel) -> None:
        self.models.pop(model.spec.name, None)
        await model.batcher.close()
        model.executor.shutdown(wait=True)
        log.info("unloaded %s", model.spec.name)

    def _queued_requests(self) -> int:
        return sum(model.batcher.queued_requests for model in self.models.values())

    # -- request kinds ----------------------------------------------------------

    async def handle_ping(self, message: dict) -> Reply:
        return {
            "status": "ok",
            "engine": self.config.name,
            "pid": os.getpid(),
            "phase": self.phase,
        }, None

    async def handle_state(self, message: dict) -> Reply:
        return {
            "status": "ok",
            "engine": self.config.name,
            "pid": os.getpid(),
            "port": self.port,
            "phase": self.phase,
            "started_at": self.started_at,
            "models": [model.describe() for model in self.models.values()],
            "loading": sorted(self._loading),
            "queue_depth": self._queued_requests(),
            "slots_in_use": sum(
                model.batcher.running for model in self.models.values()
            ),
            "cooling_reason": "",
            "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
            "limits": vars(self.config.limits),
        }, None

    async def handle_load(self, message: dict) -> Reply:
        model = await self.ensure_loaded(message["model"])
        return {"status": "ok", "model": model.describe()}, None

    async def handle_unload(self, message: dict) -> Reply:
        model = self.models.get(message["model"])
        if model is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_MODEL, f"model {message['model']!r} is not resident"
            )
        await self._unload(model)
        return {"status": "ok"}, None

    async def handle_embed(self, message: dict) -> Reply:
        texts: list[str] = message["texts"]
        model = await self.ensure_loaded(message["model"])
        if model.spec.format != "embedding":
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"model {model.spec.name!r} does not embed"
            )
        limits = self.config.limits
        # Embedding requests are cheap to hold: the queue admits queue_limit
        # batches' worth of texts before answering `overloaded` (an empty queue
        # takes any request the caps allow, however big).
        queued = model.batcher.queued_items
        if queued and queued + len(texts) > (
            limits.queue_limit * model.batcher.max_batch_size
        ):
            raise ProtocolError(ErrorCode.OVERLOADED, "the embedding queue is full")
        model.last_used = time.monotonic()
        rows: np.ndarray = await model.batcher.submit(texts)
        model.last_used = time.monotonic()
        header = {
            "status": "ok",
            "model": model.spec.name,
            "shape": list(rows.shape),
            "dtype": str(rows.dtype),
        }
        if message.get("encoding", "npy") == "json":
            return {**header, "encoding": "json", "embeddings": rows.tolist()}, None
        return {**header, "encoding": "npy"}, encode_array(rows)

    async def handle_configure(self, message: dict) -> Reply:
        config = message["config"]
        try:
            limits = Limits.from_dict(config.get("limits", vars(self.config.limits)))
            models = (
                {item["name"]: ModelSpec.from_dict(item) for item in config["models"]}
                if "models" in config
                else self.config.models
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"bad configuration: {error!r}"
            ) from None
        self.config.limits, self.config.models = limits, models
        for name, model in self.models.items():
            spec = self.config.models.get(name, model.spec)
            model.spec = spec
            model.batcher.configure(
                window_s=spec.batch_window_ms / 1000,
                max_batch_size=spec.max_batch_size,
                queue_timeout_s=self.config.limits.queue_timeout_s,
            )
        log.info("configuration updated")
        return {"status": "ok"}, None

    async def handle_shutdown(self, message: dict) -> Reply:
        log.info("shutdown requested")
        return {"status": "ok"}, None
