"""The engine process's server: one asyncio loop serving framed requests from any
number of connections, with the models resident in this process."""

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import psutil

from engines.generation.context import known_tokens, prompt_tokens
from engines.generation.runner import GenerationRunner
from engines.launch.config import LOOPBACK, EngineConfig
from engines.launch.devices import DeviceMemory, default_memory_probes
from engines.launch.environment import device_memory_file, thermal_file
from engines.runtime.batching import MicroBatcher
from engines.runtime.residency import DRAIN_TIMEOUT_S, Residency, ResidentModel
from engines.runtime.streaming import serve_generation
from engines.runtime.thermal import ThermalGate, default_probes
from engines.runtime.watcher import watch
from engines.wire.bounds import AUTH_TIMEOUT_S, MAX_AUTH_FRAME_BYTES, MAX_FRAME_BYTES
from engines.wire.errors import ErrorCode, FrameTooLarge, ProtocolError
from engines.wire.framing import (
    UNAUTHORIZED_MESSAGE,
    check_auth,
    decode_message,
    encode_array,
    frame_bytes,
    read_frame,
)
from engines.wire.replies import (
    CancelReply,
    DetokenizeReply,
    EmbedReply,
    EmbedUsage,
    ErrorReply,
    Frame,
    LoadReply,
    ModelState,
    OkReply,
    PingReply,
    RerankReply,
    StateReply,
    Temperature,
    TokenizeReply,
    UnloadReply,
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

log = logging.getLogger("roundhouse.engine")

# A reply and the array payload that follows it, if any.
Reply = tuple[Frame, bytes | None]


def cosine_similarity(query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Each row's cosine similarity to the query (0 for a zero vector)."""
    norms = np.linalg.norm(rows, axis=1) * np.linalg.norm(query)
    dots = rows @ query
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)


class EngineServer:
    """Serves one engine's models over the framed protocol on loopback: the
    connections and the dispatch of each request kind. The models themselves
    are in `residency`, generation streams in engines/runtime/streaming.py, the
    temperature and keep-alive watch in engines/runtime/watcher.py."""

    def __init__(self, config: EngineConfig, token: str) -> None:
        if not token:
            raise ValueError("an engine needs a token")
        self.config = config
        self._token = token.encode("utf-8")
        self._server: asyncio.Server | None = None
        self._stop = asyncio.Event()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task] = set()
        self._generations: dict[str, GenerationRunner] = {}
        self.thermal = ThermalGate(
            default_probes(thermal_file()),
            thresholds=config.thermal,
            devices=config.devices,
        )
        self.device_memory = DeviceMemory(
            default_memory_probes(device_memory_file()),
            config.devices,
        )
        # Set while the engine may compute; cleared while it cools. One for the
        # decode thread, one for the embedding batchers on the event loop.
        self._allowed = threading.Event()
        self._allowed.set()
        self._allowed_async = asyncio.Event()
        self._allowed_async.set()
        self.residency = Residency(
            config,
            allowed=self._allowed,
            allowed_async=self._allowed_async,
            device_memory=self.device_memory,
        )
        self._watch_task: asyncio.Task | None = None
        self.started_at = time.time()
        # Tokens generated since the engine started (the dashboard's tokens/s).
        self.tokens_generated = 0
        self.port: int | None = None

    @property
    def models(self) -> dict[str, ResidentModel]:
        return self.residency.models

    # -- lifecycle ------------------------------------------------------------

    async def startup(self) -> None:
        """Bind first (a prober sees the port taken at once), then load models."""
        # Loopback only, whatever any setting says.
        self._server = await asyncio.start_server(
            self._serve_connection, host=LOOPBACK, port=self.config.port, backlog=4096
        )
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("engine %s listening on %s:%s", self.config.name, LOOPBACK, self.port)
        self._watch_task = asyncio.create_task(
            watch(self.thermal, self._set_allowed, self.residency)
        )
        for name in self.config.preload:
            try:
                await self.residency.ensure_loaded(name)
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
        """Stop accepting, let requests in flight finish (up to the drain
        timeout), close everything. Bounded: a stuck model is left behind."""
        if self._server is not None:
            self._server.close()
        if self._watch_task is not None:
            self._watch_task.cancel()
        self._set_allowed(True)  # in-flight work finishes even if hot
        try:
            await asyncio.wait_for(self._idle.wait(), DRAIN_TIMEOUT_S)
        except TimeoutError:
            log.warning("drain timed out with %d requests in flight", self._inflight)
        for writer in list(self._writers):
            writer.close()
        if self._connections:  # let every answer finish flushing
            await asyncio.wait(list(self._connections), timeout=10)
        await self.residency.unload_all()
        log.info("engine %s stopped", self.config.name)

    def _set_allowed(self, allowed: bool) -> None:
        for event in (self._allowed, self._allowed_async):
            if allowed:
                event.set()
            else:
                event.clear()

    # -- connections ----------------------------------------------------------

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._writers.add(writer)
        self._connections.add(asyncio.current_task())
        try:
            if not await self._authenticated(reader, writer):
                return
            if self._stop.is_set():
                # Stopping: the request is not read. Said as `unreachable`, so
                # the caller knows it never started here and may send it to
                # another engine (a connection closed unanswered reads as an
                # engine that died with the request, which is not retried).
                refusal = ErrorReply(
                    code=ErrorCode.UNREACHABLE,
                    message=f"engine {self.config.name} is stopping",
                )
                with contextlib.suppress(ConnectionError, OSError):
                    writer.write(refusal.encoded())
                    await writer.drain()
                return
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
                await self._answer(payload, reader, writer)
        finally:
            self._writers.discard(writer)
            writer.close()
            # Wait for the transport to flush: an answer still buffered when the
            # engine exits would reach its caller cut off.
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
            self._connections.discard(asyncio.current_task())

    async def _answer(
        self,
        payload: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self._inflight += 1
        self._idle.clear()
        after: Callable[[], None] | None = None
        try:
            try:
                request = parse_request(decode_message(payload), size=len(payload))
                if isinstance(request, GenerateRequest):
                    received = time.perf_counter()
                    async with self._leased(request.model, request.keep_alive_s) as (
                        model,
                        load_ms,
                    ):
                        await serve_generation(
                            model,
                            request,
                            reader,
                            writer,
                            received=received,
                            load_ms=load_ms,
                            generations=self._generations,
                            count_tokens=self._count_tokens,
                        )
                    return
                reply, array = await self._dispatch(request)
                if isinstance(request, ShutdownRequest):
                    after = self.request_stop
            except ProtocolError as error:
                reply, array = ErrorReply.of(error), None
            except Exception:
                log.exception("request failed")
                reply = ErrorReply(code=ErrorCode.INTERNAL, message="internal error")
                array = None
            data = reply.encoded()
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

    async def _dispatch(self, request: Request) -> Reply:
        """A request but a generation to the handler of its kind."""
        handler: Callable[[Any], Awaitable[Reply]] = getattr(
            self, f"handle_{request.kind}"
        )
        return await handler(request)

    async def _authenticated(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Whether the connection's first frame is an auth frame with our
        token. It is read under the small cap: a caller without the token
        never gets a larger frame read (its header alone is refused), nor
        anything decoded but those few bytes. Otherwise answered
        `unauthorized`; the caller then closes the connection."""
        try:
            async with asyncio.timeout(AUTH_TIMEOUT_S):
                payload = await read_frame(reader, max_bytes=MAX_AUTH_FRAME_BYTES)
            if payload is None:
                return False
            check_auth(payload, self._token)
            return True
        except (ConnectionError, OSError, TimeoutError):
            return False
        except FrameTooLarge as error:
            log.warning("refusing a connection before its token: %s", error.message)
        except ProtocolError:
            pass
        with contextlib.suppress(ConnectionError, OSError):
            refusal = ErrorReply(
                code=ErrorCode.UNAUTHORIZED, message=UNAUTHORIZED_MESSAGE
            )
            writer.write(refusal.encoded())
            await writer.drain()
        return False

    # -- health -----------------------------------------------------------------

    @property
    def phase(self) -> str:
        return "loading" if self.residency.loading else "ready"

    # -- request kinds ----------------------------------------------------------

    async def handle_ping(self, request: PingRequest) -> Reply:
        return PingReply(
            engine=self.config.name, pid=os.getpid(), phase=self.phase
        ), None

    async def handle_state(self, request: StateRequest) -> Reply:
        """What the supervisor records. Answered while models load (loads run
        off the loop); `healthy` is false with the reason when generation cannot
        go on (its loop died or is stuck): the supervisor then replaces us."""
        reason = self.residency.unhealthy_reason()
        return StateReply(
            engine=self.config.name,
            pid=os.getpid(),
            port=self.port,
            phase=self.phase,
            healthy=not reason,
            unhealthy_reason=reason,
            started_at=self.started_at,
            models=[ModelState(**model.describe()) for model in self.models.values()],
            loading=sorted(self.residency.loading),
            unloading=self.residency.draining(),
            queue_depth=self.residency.queued(),
            slots_in_use=self.residency.busy(),
            cooling_reason=self.thermal.reason,
            rss_mib=round(psutil.Process().memory_info().rss / 2**20, 1),
            temperatures=[Temperature(**t) for t in self.thermal.temperatures],
            tokens_generated=self.tokens_generated,
            limits=vars(self.config.limits),
        ), None

    def _count_tokens(self, count: int) -> None:
        self.tokens_generated += count

    @contextlib.asynccontextmanager
    async def _leased(self, name: str, keep_alive_s: float | None):
        """Residency.using for one request, with how long it waited for the
        model to be loaded (ms; 0 when it was resident as the request came)."""
        resident = name in self.residency.models and name not in (
            self.residency.draining()
        )
        asked = time.perf_counter()
        async with self.residency.using(name, keep_alive_s=keep_alive_s) as model:
            yield model, 0.0 if resident else (time.perf_counter() - asked) * 1000

    async def handle_load(self, request: LoadRequest) -> Reply:
        async with self._leased(request.model, request.keep_alive_s) as (model, _):
            return LoadReply(model=ModelState(**model.describe())), None

    async def handle_unload(self, request: UnloadRequest) -> Reply:
        """Drain, then unload (see Residency.unload_drained); `when_idle`: as
        its keep-alive would, now if it is idle, else once it is (the
        watcher's next look)."""
        if request.when_idle:
            if self.residency.keep_alive_set(request.model, 0.0):
                await self.residency.expire_idle()
            return UnloadReply(drained=request.model not in self.residency.models), None
        await self.residency.unload_drained(request.model)
        return UnloadReply(drained=True), None

    async def handle_embed(self, request: EmbedRequest) -> Reply:
        async with self._leased(request.model, request.keep_alive_s) as leased:
            model, load_ms = leased
            return await self._embed(model, request, load_ms=load_ms)

    async def _embed(
        self, model: ResidentModel, request: EmbedRequest, *, load_ms: float = 0.0
    ) -> Reply:
        texts = request.texts
        if model.spec.task == "rerank":  # its batches take pairs, not texts
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"model {model.spec.name!r} is a reranker: it does not embed",
            )
        batcher = self._batcher(model, len(texts), "embed")
        rows, tokens = await batcher.submit_counted(texts)
        reply = EmbedReply(
            model=model.spec.name,
            shape=list(rows.shape),
            dtype=str(rows.dtype),
            usage=EmbedUsage(prompt_tokens=tokens),
            encoding=request.encoding,
            embeddings=rows.tolist() if request.encoding == "json" else None,
            load_ms=round(load_ms, 3) if load_ms else None,
        )
        return reply, encode_array(rows) if request.encoding == "npy" else None

    def _batcher(self, model: ResidentModel, items: int, what: str) -> MicroBatcher:
        """The model's micro-batcher, if it may take `items` more now;
        bad_request for a model without one (a generator), overloaded when
        its queue is full."""
        batcher = model.batcher
        if batcher is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"model {model.spec.name!r} does not {what}"
            )
        limits = self.config.limits
        # Batched requests are cheap to hold: the queue admits queue_limit
        # batches' worth of items before answering `overloaded` (an empty
        # queue takes any request the caps allow, however big).
        queued = batcher.queued_items
        if queued and queued + items > limits.queue_limit * batcher.max_batch_size:
            raise ProtocolError(ErrorCode.OVERLOADED, "the model's batch queue is full")
        # Queue timeout 0: admitted only if the next batch can take it now.
        if limits.queue_timeout_s == 0 and (
            batcher.running
            or not self._allowed_async.is_set()
            or (queued and queued + items > batcher.max_batch_size)
        ):
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                "no batch can take this request now (queue timeout is 0)",
            )
        return batcher

    async def handle_rerank(self, request: RerankRequest) -> Reply:
        """Scores of the documents against the query, in their order: a
        cross-encoder (task `rerank`) scores each (query, document) pair; an
        embedder embeds the query with the documents and answers their
        cosine similarity. Either way the items join the model's
        micro-batches with other callers'."""
        documents = request.documents
        async with self.residency.using(request.model) as model:
            if model.spec.task == "rerank":
                batcher = self._batcher(model, len(documents), "rerank")
                pairs = [(request.query, document) for document in documents]
                scores, tokens = await batcher.submit_counted(pairs)
            else:
                batcher = self._batcher(model, len(documents) + 1, "rerank")
                rows, tokens = await batcher.submit_counted([request.query, *documents])
                scores = cosine_similarity(rows[0], rows[1:])
            return RerankReply(
                model=model.spec.name,
                scores=[float(score) for score in scores],
                usage=EmbedUsage(prompt_tokens=tokens),
            ), None

    async def handle_tokenize(self, request: TokenizeRequest) -> Reply:
        """The prompt's tokens as a generation of it renders and tokenizes
        them (engines/generation/context.py), off the event loop."""
        async with self.residency.using(request.model) as model:
            backend = self._generator(model, "tokenize")
            fields = request.model_dump(exclude_none=True)
            loop = asyncio.get_running_loop()
            tokens = await loop.run_in_executor(
                model.executor, prompt_tokens, backend, fields
            )
            return TokenizeReply(
                model=model.spec.name,
                tokens=tokens,
                count=len(tokens),
                max_model_len=backend.ctx_per_slot,
            ), None

    async def handle_detokenize(self, request: DetokenizeRequest) -> Reply:
        async with self.residency.using(request.model) as model:
            backend = self._generator(model, "detokenize")
            tokens = known_tokens(backend, request.tokens, "tokens")
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(
                model.executor, backend.detokenize, tokens
            )
            return DetokenizeReply(model=model.spec.name, text=text), None

    @staticmethod
    def _generator(model: ResidentModel, what: str) -> Any:
        """A generation model's backend; bad_request for another model."""
        if model.runner is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"model {model.spec.name!r} does not generate: it cannot {what}",
            )
        return model.runner.backend

    async def handle_configure(self, request: ConfigureRequest) -> Reply:
        """Apply the request's LiveConfig: the settings it gives replace the
        running ones, without a restart."""
        live = request.config  # typed and checked when the request was read
        live.apply(self.config)
        if live.thermal is not None or live.devices is not None:
            self.device_memory.devices = set(self.config.devices)
            self.thermal.configure(
                thresholds=self.config.thermal, devices=self.config.devices
            )
        self.residency.configure(self.config.limits)
        log.info("configuration updated")
        return OkReply(), None

    async def handle_cancel(self, request: CancelRequest) -> Reply:
        runner = self._generations.get(request.request_id)
        found = runner is not None and runner.cancel(request.request_id)
        return CancelReply(cancelled=found), None

    async def handle_shutdown(self, request: ShutdownRequest) -> Reply:
        log.info("shutdown requested")
        return OkReply(), None
