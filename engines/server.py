"""The engine process's server: one asyncio loop serving framed requests from any
number of connections, with the models resident in this process."""

import asyncio
import collections
import contextlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil

from .batching import MicroBatcher
from .config import (
    DEVICE_MEMORY_FILE_ENV,
    GPU_BACKENDS,
    LOOPBACK,
    THERMAL_FILE_ENV,
    EngineConfig,
    Limits,
    ModelSpec,
)
from .devices import DeviceMemory, default_memory_probes
from .generation import (
    DecodeThread,
    GenerationBackend,
    GenerationRequest,
    GenerationRunner,
)
from .memory import estimate_model_mib
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
from .textgen import SamplingParams
from .thermal import READ_INTERVAL_S, ThermalGate, Thresholds, default_probes

log = logging.getLogger("roundhouse.engine")

# How long `shutdown` waits for requests in flight before closing anyway.
DRAIN_TIMEOUT_S = 30.0

Reply = tuple[dict[str, Any], bytes | None]


@dataclass
class ResidentModel:
    """A model loaded in this engine: an embedder with its micro-batcher, or a
    generator with its decode thread; and its measured memory."""

    spec: ModelSpec
    backend: Any
    executor: ThreadPoolExecutor
    memory_mib: float
    estimated_mib: float | None = None
    device_mib: float = 0.0  # on the engine's GPUs (measured after the load)
    inflight: int = 0  # requests holding this model: it is never evicted then
    batcher: MicroBatcher | None = None
    runner: GenerationRunner | None = None
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def queued(self) -> int:
        if self.runner is not None:
            return self.runner.queued
        return self.batcher.queued_requests

    @property
    def busy(self) -> int:
        return self.runner.busy if self.runner is not None else self.batcher.running

    def describe(self) -> dict[str, Any]:
        described = {
            "name": self.spec.name,
            "format": self.spec.format,
            "memory_mib": round(self.memory_mib, 1),
            "device_memory_mib": round(self.device_mib, 1),
            "estimated_mib": self.estimated_mib and round(self.estimated_mib, 1),
            "loaded_at": self.loaded_at,
            "idle_s": round(time.monotonic() - self.last_used, 1),
            "inflight": self.inflight,
            "queued": self.queued,
            "busy": self.busy,
        }
        if self.batcher is not None:
            described.update(
                batches=self.batcher.stats.batches,
                batched_items=self.batcher.stats.items,
                largest_batch=self.batcher.stats.largest,
            )
        if self.runner is not None:
            described.update(slots=self.runner.backend.n_slots, steps=self.runner.steps)
        return described


def _load_backend(spec: ModelSpec, backend: str, limits: Limits):
    """Construct a model backend (imports the ML library on first use)."""
    if spec.format == "embedding":
        from .backends.embedding import EmbeddingBackend

        return EmbeddingBackend(
            spec.path, backend=backend, batch_size=spec.max_batch_size
        )
    generation = {
        "n_slots": spec.slots or limits.max_slots_per_model,
        "context_length": spec.context_length,
        "n_threads": limits.threads or None,
        "chat_template": spec.chat_template,
    }
    if spec.format == "gguf":
        from .backends.gguf import LlamaBackend

        gpu = backend in GPU_BACKENDS
        return LlamaBackend(spec.path, gpu=gpu, **generation)
    if spec.format == "transformers":
        from .backends.hf import TransformersBackend

        device = "cuda" if backend in ("cuda", "rocm") else "cpu"
        return TransformersBackend(spec.path, device=device, **generation)
    raise ProtocolError(
        ErrorCode.BAD_REQUEST,
        f"model {spec.name!r} has format {spec.format!r}, which engines do not serve",
    )


@dataclass
class _Budget:
    """One kind of memory while making room: what the load needs, what is free
    now (less the margin), and what resident models hold."""

    kind: str
    need: float
    room: float
    held: float = 0.0


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def _short(resident: int, models_max: int, budgets: list[_Budget]) -> bool:
    """Whether a load must still wait or evict: models-max or any memory."""
    return resident >= models_max or any(b.room < b.need for b in budgets)


class EngineServer:
    """Serves one engine's models over the framed protocol on loopback."""

    def __init__(self, config: EngineConfig, token: str) -> None:
        if not token:
            raise ValueError("an engine needs a token")
        self.config = config
        self._token = token.encode("utf-8")
        self.models: dict[str, ResidentModel] = {}
        self._residency = asyncio.Lock()
        self._loading: set[str] = set()
        # Models being drained by `unload`: set once the model is gone. New
        # requests for a draining model wait on it (up to the queue timeout).
        self._draining: dict[str, asyncio.Event] = {}
        self._server: asyncio.Server | None = None
        self._stop = asyncio.Event()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task] = set()
        self._generations: dict[str, GenerationRunner] = {}
        self._decoder: DecodeThread | None = None  # started with the first LLM
        self.thermal = ThermalGate(
            default_probes(os.environ.get(THERMAL_FILE_ENV)),
            thresholds=Thresholds.from_dict(config.thermal),
            devices=config.devices,
        )
        self.device_memory = DeviceMemory(
            default_memory_probes(os.environ.get(DEVICE_MEMORY_FILE_ENV)),
            config.devices,
        )
        # Set while the engine may compute; cleared while it cools. One for the
        # decode thread, one for the embedding batchers on the event loop.
        self._allowed = threading.Event()
        self._allowed.set()
        self._allowed_async = asyncio.Event()
        self._allowed_async.set()
        self._thermal_task: asyncio.Task | None = None
        # Notified when a model becomes idle or leaves: loads waiting for room.
        self._room = asyncio.Condition()
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
        self._thermal_task = asyncio.create_task(self._watch_temperature())
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
        if self._thermal_task is not None:
            self._thermal_task.cancel()
        self._set_allowed(True)  # in-flight work finishes even if hot
        try:
            await asyncio.wait_for(self._idle.wait(), DRAIN_TIMEOUT_S)
        except TimeoutError:
            log.warning("drain timed out with %d requests in flight", self._inflight)
        for writer in list(self._writers):
            writer.close()
        if self._connections:  # let every answer finish flushing
            await asyncio.wait(list(self._connections), timeout=10)
        for model in list(self.models.values()):
            await self._unload(model)
        log.info("engine %s stopped", self.config.name)

    # -- thermal ----------------------------------------------------------------

    async def _watch_temperature(self) -> None:
        """Read the probes about once a second (off the loop: nvidia-smi may be
        slow) and pause or resume all work of this engine."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                reason = await loop.run_in_executor(None, self.thermal.update)
            except Exception:  # a broken sensor must not stop the engine
                log.exception("reading temperatures failed")
                reason = ""
            if reason and self._allowed.is_set():
                log.warning("cooling: %s", reason)
            elif not reason and not self._allowed.is_set():
                log.info("cooled down: resuming")
            self._set_allowed(not reason)
            await self._expire_idle()
            await asyncio.sleep(READ_INTERVAL_S)

    async def _expire_idle(self) -> None:
        """Unload models idle longer than their keep-alive (0: no time limit)."""
        now = time.monotonic()
        for model in list(self.models.values()):
            keep = model.spec.keep_alive_s
            if keep and model.inflight == 0 and now - model.last_used > keep:
                log.info("unloading %s: idle for %d s", model.spec.name, keep)
                await self._unload(model)
                async with self._room:
                    self._room.notify_all()

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
                message = decode_message(payload)
                self._authenticate(message)
                kind = validate_request(message)
                if kind in ("generate", "generate_stream"):
                    await self._serve_generation(message, reader, writer)
                    return
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
        drained = self._draining.get(name)
        if drained is not None:
            await self._wait_for_drain(name, drained)
        model = self.models.get(name)
        if model is not None:
            return model
        spec = self.config.models.get(name)
        if spec is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_MODEL, f"model {name!r} is not configured here"
            )
        # One residency decision at a time: two loads deciding at once could
        # both count the same free memory or the same free place under models-max.
        async with self._residency:
            if name in self.models:
                return self.models[name]
            self._loading.add(name)
            try:
                await self._make_room(spec)
                return await self._load(spec)
            finally:
                self._loading.discard(name)

    async def _wait_for_drain(self, name: str, drained: asyncio.Event) -> None:
        """Queue behind an unload of `name`: the request then reloads the model.
        Overdue work is refused as it would be in any queue (timeout 0: at once)."""
        timeout = self.config.limits.queue_timeout_s
        try:
            await asyncio.wait_for(drained.wait(), timeout)
        except TimeoutError:
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"model {name!r} is unloading; waited {timeout:g} s for it to drain",
            ) from None

    @contextlib.asynccontextmanager
    async def using(self, name: str):
        """Lease a resident model for one request: loaded if needed, and never
        evicted while leased."""
        model = await self.ensure_loaded(name)
        model.inflight += 1  # no await since the lookup: eviction cannot slip in
        model.last_used = time.monotonic()
        try:
            yield model
        finally:
            model.inflight -= 1
            model.last_used = time.monotonic()
            if model.inflight == 0:
                async with self._room:
                    self._room.notify_all()

    async def _make_room(self, spec: ModelSpec) -> None:
        """Evict idle models, least recently used first, until `spec` fits in
        memory (host available minus the margin; on a GPU engine, also its
        cards' free memory minus the margin) and under models-max.

        A leased model is never evicted. If room can only come from a busy
        model, wait (up to the queue timeout) for it to become idle; if the
        model cannot fit even with every other model gone, fail at once with
        `insufficient_memory` naming the shortfall.
        """
        loop = asyncio.get_running_loop()
        limits = self.config.limits
        device_free = await self._device_free()
        on_device = device_free is not None
        estimate = None
        if not spec.measured_mib or (on_device and not spec.measured_device_mib):
            estimate = await loop.run_in_executor(None, self._estimate, spec)
        # On a GPU engine the weights and KV cache go to the cards: the host
        # needs only what an earlier load measured there.
        need = spec.measured_mib or (0.0 if on_device else estimate)
        need_device = (spec.measured_device_mib or estimate) if on_device else 0.0
        deadline = time.monotonic() + limits.queue_timeout_s
        async with self._room:
            while True:
                free = psutil.virtual_memory().available / 2**20
                host = _Budget("host", need, free - limits.memory_margin_mib)
                host.held = sum(m.memory_mib for m in self.models.values())
                budgets = [host]
                if on_device:
                    device = _Budget(
                        "GPU", need_device, device_free - limits.memory_margin_mib
                    )
                    device.held = sum(m.device_mib for m in self.models.values())
                    budgets.append(device)
                for budget in budgets:
                    if budget.need > budget.room + budget.held:
                        raise ProtocolError(
                            ErrorCode.INSUFFICIENT_MEMORY,
                            f"{spec.name} needs about {budget.need:.0f} MiB of "
                            f"{budget.kind} memory; at most "
                            f"{max(budget.room + budget.held, 0):.0f} MiB can be "
                            f"made free (margin {limits.memory_margin_mib} MiB): "
                            f"short by {budget.need - budget.room - budget.held:.0f} "
                            "MiB",
                        )
                idle = sorted(
                    (m for m in self.models.values() if m.inflight == 0),
                    key=lambda m: m.last_used,
                )
                victims: list[ResidentModel] = []
                kept = len(self.models)
                while idle and _short(kept, limits.models_max, budgets):
                    victim = idle.pop(0)
                    victims.append(victim)
                    kept -= 1
                    host.room += victim.memory_mib
                    if on_device:
                        device.room += victim.device_mib
                if not _short(kept, limits.models_max, budgets):
                    for victim in victims:
                        log.info(
                            "evicting %s to make room for %s",
                            victim.spec.name,
                            spec.name,
                        )
                        await self._unload(victim)
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProtocolError(
                        ErrorCode.INSUFFICIENT_MEMORY,
                        f"no room for {spec.name}: the resident models stayed busy "
                        f"for {limits.queue_timeout_s:g} s",
                    )
                try:
                    await asyncio.wait_for(self._room.wait(), remaining)
                except TimeoutError:
                    continue
                device_free = await self._device_free() if on_device else None

    async def _device_free(self) -> float | None:
        """Free memory on this engine's cards (None: not a GPU engine, or no
        cards seen). Read off the loop: nvidia-smi may be slow."""
        if self.config.backend not in GPU_BACKENDS:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.device_memory.free_mib)

    def _estimate(self, spec: ModelSpec) -> float:
        slots = spec.slots or self.config.limits.max_slots_per_model
        try:
            return estimate_model_mib(spec, slots=slots)
        except (OSError, ValueError, KeyError):
            return 0.0  # unknown: loading will tell

    async def _load(self, spec: ModelSpec) -> ResidentModel:
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{spec.name}")
        process = psutil.Process()
        before = process.memory_info().rss
        on_device = self.config.backend in GPU_BACKENDS
        device_before = (
            await loop.run_in_executor(None, self.device_memory.used_mib)
            if on_device
            else None
        )
        log.info("loading %s from %s", spec.name, spec.path)
        try:
            backend = await loop.run_in_executor(
                executor, _load_backend, spec, self.config.backend, self.config.limits
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
        model = ResidentModel(spec, backend, executor, memory_mib)
        if device_before is not None:
            device_after = await loop.run_in_executor(None, self.device_memory.used_mib)
            grown = max((device_after or 0.0) - device_before, 0.0)
            # A card that shows no growth (memory the runtime had reserved
            # earlier, or a card we cannot read) holds what we expected.
            model.device_mib = grown or spec.measured_device_mib or 0.0
        try:
            slots = getattr(backend, "n_slots", 1)
            model.estimated_mib = estimate_model_mib(spec, slots=slots)
        except (OSError, ValueError, KeyError) as error:
            log.warning("no memory estimate for %s: %s", spec.name, error)
        if device_before is not None and not model.device_mib:
            model.device_mib = model.estimated_mib or 0.0
        limits = self.config.limits
        if isinstance(backend, GenerationBackend):
            if self._decoder is None:
                self._decoder = DecodeThread(
                    self._allowed, max_parallel=limits.max_parallel_requests
                )
            model.runner = GenerationRunner(
                backend,
                name=spec.name,
                queue_limit=limits.queue_limit,
                queue_timeout_s=limits.queue_timeout_s,
                decoder=self._decoder,
            )
        else:
            model.batcher = MicroBatcher(
                getattr(backend, "encode_counted", backend.encode),
                executor=executor,
                window_s=spec.batch_window_ms / 1000,
                max_batch_size=spec.max_batch_size,
                queue_timeout_s=limits.queue_timeout_s,
                allowed=self._allowed_async,
            )
        self.models[spec.name] = model
        log.info("loaded %s (%.0f MiB)", spec.name, memory_mib)
        return model

    async def _unload(self, model: ResidentModel) -> None:
        self.models.pop(model.spec.name, None)
        if model.batcher is not None:
            await model.batcher.close()
        if model.runner is not None:
            # Running requests finish first; the decode thread then frees the model.
            await asyncio.get_running_loop().run_in_executor(
                model.executor, model.runner.close
            )
        model.executor.shutdown(wait=True)
        log.info("unloaded %s", model.spec.name)

    def _queued_requests(self) -> int:
        return sum(model.queued for model in self.models.values())

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
            "slots_in_use": sum(model.busy for model in self.models.values()),
            "cooling_reason": self.thermal.reason,
            "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
            "limits": vars(self.config.limits),
        }, None

    async def handle_load(self, message: dict) -> Reply:
        model = await self.ensure_loaded(message["model"])
        return {"status": "ok", "model": model.describe()}, None

    async def handle_unload(self, message: dict) -> Reply:
        """Drain, then unload: requests in flight and those already queued for
        the model finish; a new request waits for the drain (up to its queue
        timeout) and then loads the model again."""
        name = message["model"]
        async with self._residency:
            model = self.models.get(name)
            if model is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_MODEL, f"model {name!r} is not resident"
                )
            drained = self._draining.setdefault(name, asyncio.Event())
            try:
                async with self._room:
                    try:
                        await asyncio.wait_for(
                            self._room.wait_for(lambda: model.inflight == 0),
                            DRAIN_TIMEOUT_S,
                        )
                    except TimeoutError:
                        log.warning(
                            "unloading %s: %d requests still running after %g s "
                            "are cancelled",
                            name,
                            model.inflight,
                            DRAIN_TIMEOUT_S,
                        )
                await self._unload(model)
            finally:
                del self._draining[name]
                drained.set()
        return {"status": "ok", "drained": True}, None

    async def handle_embed(self, message: dict) -> Reply:
        async with self.using(message["model"]) as model:
            return await self._embed(model, message)

    async def _embed(self, model: ResidentModel, message: dict) -> Reply:
        texts: list[str] = message["texts"]
        if model.batcher is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"model {model.spec.name!r} does not embed"
            )
        limits = self.config.limits
        # Embedding requests are cheap to hold: the queue admits queue_limit
        # batches' worth of texts before answering `overloaded` (an empty queue
        # takes any request the caps allow, however big).
        batcher = model.batcher
        queued = batcher.queued_items
        if queued and queued + len(texts) > limits.queue_limit * batcher.max_batch_size:
            raise ProtocolError(ErrorCode.OVERLOADED, "the embedding queue is full")
        # Queue timeout 0: admitted only if the next batch can take it now.
        if limits.queue_timeout_s == 0 and (
            batcher.running
            or not self._allowed_async.is_set()
            or (queued and queued + len(texts) > batcher.max_batch_size)
        ):
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                "no batch can take this request now (queue timeout is 0)",
            )
        rows, tokens = await model.batcher.submit_counted(texts)
        header = {
            "status": "ok",
            "model": model.spec.name,
            "shape": list(rows.shape),
            "dtype": str(rows.dtype),
            "usage": {"prompt_tokens": tokens},
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
        if self._decoder is not None:
            with self._decoder.wake:
                self._decoder.max_parallel = limits.max_parallel_requests
                self._decoder.wake.notify_all()
        if "thermal" in config or "devices" in config:
            self.config.thermal = dict(config.get("thermal", self.config.thermal))
            self.config.devices = [str(d) for d in config.get("devices", [])]
            self.device_memory.devices = set(self.config.devices)
            self.thermal.configure(
                thresholds=Thresholds.from_dict(self.config.thermal),
                devices=self.config.devices,
            )
        for name, model in self.models.items():
            spec = self.config.models.get(name, model.spec)
            model.spec = spec
            if model.runner is not None:
                model.runner.queue_limit = limits.queue_limit
                model.runner.queue_timeout_s = limits.queue_timeout_s
                continue
            model.batcher.configure(
                window_s=spec.batch_window_ms / 1000,
                max_batch_size=spec.max_batch_size,
                queue_timeout_s=self.config.limits.queue_timeout_s,
            )
        log.info("configuration updated")
        return {"status": "ok"}, None

    async def handle_cancel(self, message: dict) -> Reply:
        runner = self._generations.get(message["request_id"])
        found = runner is not None and runner.cancel(message["request_id"])
        return {"status": "ok", "cancelled": found}, None

    async def _serve_generation(
        self,
        message: dict,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Run one generation, writing its frames: for generate_stream a start
        frame, one frame per text chunk and a final frame; for generate one
        frame with the whole text. A caller that hangs up is cancelled. The final
        frame's `timings` are measured here, from the request's arrival (a load
        it waits for included): to the first token and to the end, in ms."""
        received = time.perf_counter()
        async with self.using(message["model"]) as model:
            await self._generate(model, message, reader, writer, received=received)

    async def _generate(
        self,
        model: ResidentModel,
        message: dict,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        received: float,
    ) -> None:
        stream = message["kind"] == "generate_stream"
        if model.runner is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"model {model.spec.name!r} does not generate"
            )
        first_token_ms: float | None = None
        backend = model.runner.backend
        params = SamplingParams.from_request(message, model.spec.sampling)
        prompt_tokens = backend.tokenize(backend.render_prompt(message))
        loop = asyncio.get_running_loop()
        # The decode thread's events land here; `ready` wakes this coroutine for
        # them or for the caller hanging up. Events that arrived together leave
        # in one write (a last token and the final frame, typically): each write
        # wakes the caller, which costs both sides CPU.
        events: collections.deque[dict] = collections.deque()
        ready = asyncio.Event()

        def arrived(event: dict) -> None:
            events.append(event)
            ready.set()

        request = GenerationRequest(
            prompt_tokens=prompt_tokens,
            params=params,
            emit=lambda event: loop.call_soon_threadsafe(arrived, event),
        )
        if message.get("request_id"):
            request.id = message["request_id"]
        if request.id in self._generations:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "request_id already in use")
        model.runner.submit(request)
        self._generations[request.id] = model.runner
        # The caller sends nothing while its request runs: end of stream on the
        # connection means it went away.
        hangup = asyncio.ensure_future(reader.read(1))
        hangup.add_done_callback(lambda _: ready.set())
        parts: list[str] = []
        try:
            if stream:
                await self._write(
                    writer, {"status": "ok", "event": "start", "request_id": request.id}
                )
            while True:
                await ready.wait()
                ready.clear()
                frames: list[bytes] = []
                final = False
                while events and not final:
                    event = events.popleft()
                    if event["event"] == "token":
                        if first_token_ms is None:
                            first_token_ms = _ms_since(received)
                        if stream:
                            frames.append(encode_message({"status": "ok", **event}))
                        else:
                            parts.append(event["text"])
                        continue
                    final = True
                    if event["event"] == "error":
                        reply = error_frame(event["code"], event["message"])
                    else:
                        reply = {"status": "ok", **event, "request_id": request.id}
                        reply["timings"] = {
                            "first_token_ms": first_token_ms,
                            "total_ms": _ms_since(received),
                        }
                        if not stream:
                            reply["text"] = "".join(parts)
                    frames.append(encode_message(reply))
                if frames:
                    writer.write(b"".join(frames))
                    await writer.drain()
                if final:
                    return
                if hangup.done():
                    model.runner.cancel(request.id)
                    log.info("caller of %s went away: cancelled", request.id)
                    return
        except (ConnectionError, OSError):
            model.runner.cancel(request.id)
        finally:
            # Settle the watcher before the connection reads its next frame (two
            # readers on one stream is an error).
            hangup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hangup
            self._generations.pop(request.id, None)

    async def _write(self, writer: asyncio.StreamWriter, message: dict) -> None:
        writer.write(encode_message(message))
        await writer.drain()

    async def handle_shutdown(self, message: dict) -> Reply:
        log.info("shutdown requested")
        return {"status": "ok"}, None
