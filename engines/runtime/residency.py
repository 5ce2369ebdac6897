"""Which models an engine holds: loading (once, whoever asks), leases, making
room by evicting idle models (memory and models-max), drains, keep-alive expiry,
and the one decode thread the generation models share."""

import asyncio
import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil

from engines.backends.factory import (
    card_label,
    load_backend,
    offload_cards,
    visible_cards,
)
from engines.backends.hf_placement import TORCH_GPU_BACKENDS
from engines.backends.memory import SlotPlan, estimate_model_mib, plan_slots
from engines.generation.runner import (
    DecodeThread,
    GenerationBackend,
    GenerationRunner,
)
from engines.launch.config import GPU_BACKENDS, EngineConfig, Limits, ModelSpec
from engines.launch.devices import CardMemory, DeviceMemory
from engines.runtime.batching import MicroBatcher
from engines.wire.errors import ErrorCode, ProtocolError

log = logging.getLogger("roundhouse.engine")

# How long an unload waits for the model's requests before cancelling them, and
# how long freeing a model may take before it is left as it is.
DRAIN_TIMEOUT_S = 30.0


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
    # What the load took on each card (by its label in offload plans), as
    # measured; empty where no card showed growth.
    device_cards_mib: dict[str, float] = field(default_factory=dict)
    inflight: int = 0  # requests holding this model: it is never evicted then
    batcher: MicroBatcher | None = None
    runner: GenerationRunner | None = None
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    # The idle time the last request asked for (Ollama's `keep_alive`), in
    # seconds: None, the model's own keep_alive_s; below 0, no limit; 0,
    # unloaded as soon as it is idle.
    asked_keep_alive_s: float | None = None

    def keep_alive_limit(self) -> float | None:
        """Idle seconds before the watcher unloads the model (None: no limit).
        A model whose own keep-alive is 0 stays until its memory is needed
        whatever a request asks: an operator chose that, or its replica is
        placed on this engine (the supervisor would load it again). Otherwise
        the last request's ask, if it made one, else the model's own."""
        own = self.spec.keep_alive_s
        if not own:
            return None
        asked = self.asked_keep_alive_s
        if asked is None:
            return float(own)
        return None if asked < 0 else asked

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
            "keep_alive_s": self.keep_alive_limit(),
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
            backend = self.runner.backend
            described.update(
                slots=backend.n_slots,
                steps=self.runner.steps,
                tokens_per_s=_rounded(self.runner.rate.per_s()),
            )
            plan = getattr(backend, "plan", None)
            if plan is not None:  # slots, context, and the KV pool's size
                described.update(plan.describe())
            offload = getattr(backend, "offload", None)
            if offload is not None and offload.devices:
                # A GGUF model's layers on the engine's cards (none: a CPU engine).
                described["offload"] = offload.describe()
            placement = getattr(backend, "placement_text", "")
            if placement:  # a transformers model's precision and device map
                described["placement"] = placement
            described["copied_tokens"] = getattr(backend, "copied_tokens", 0)
        if self.device_cards_mib:
            described["device_cards_mib"] = {
                card: round(mib, 1) for card, mib in self.device_cards_mib.items()
            }
        return described


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _card_use(cards: list[CardMemory]) -> dict[str, float]:
    """Each card's used MiB by its label in offload plans (`gpu-N`, else its
    UUID or id)."""
    return {card_label(card, place): card.used_mib for place, card in enumerate(cards)}


def _estimate(
    spec: ModelSpec, limits: Limits, plan: SlotPlan | None = None, backend: str = "cpu"
) -> float | None:
    """The model's estimated memory on an engine of `backend`, its slots' KV
    pool included (the plan it was loaded with, else a new one; None: its
    files do not tell). Reads file headers: run it off the event loop."""
    try:
        if spec.format == "embedding":
            return estimate_model_mib(spec)
        plan = plan or plan_slots(spec, limits)
        return estimate_model_mib(spec, pool_tokens=plan.pool_tokens, backend=backend)
    except (OSError, ValueError, KeyError) as error:
        log.warning("no memory estimate for %s: %s", spec.name, error)
        return None


@dataclass
class _Budget:
    """One kind of memory while making room: what the load needs, what is free
    now (less the margin), and what resident models hold."""

    kind: str
    need: float
    room: float
    held: float = 0.0


def _short(resident: int, models_max: int, budgets: list[_Budget]) -> bool:
    """Whether a load must still wait or evict: models-max or any memory."""
    return resident >= models_max or any(b.room < b.need for b in budgets)


class Residency:
    """The models resident in one engine process."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        allowed: threading.Event,
        allowed_async: asyncio.Event,
        device_memory: DeviceMemory,
    ) -> None:
        self.config = config
        self.models: dict[str, ResidentModel] = {}
        self.loading: set[str] = set()
        self.decoder: DecodeThread | None = None  # started with the first LLM
        self._allowed = allowed
        self._allowed_async = allowed_async
        self._device_memory = device_memory
        # One residency decision at a time: two loads deciding at once could
        # both count the same free memory or the same free place under models-max.
        self._deciding = asyncio.Lock()
        # Models being drained by `unload`: set once the model is gone. New
        # requests for a draining model wait on it (up to the queue timeout).
        self._draining: dict[str, asyncio.Event] = {}
        # Notified when a model becomes idle or leaves: loads waiting for room.
        self._room = asyncio.Condition()

    # -- reading ----------------------------------------------------------------

    def queued(self) -> int:
        return sum(model.queued for model in self.models.values())

    def busy(self) -> int:
        return sum(model.busy for model in self.models.values())

    def draining(self) -> list[str]:
        """Models `unload` is draining: still resident, new requests wait."""
        return sorted(self._draining)

    def unhealthy_reason(self) -> str:
        """Why the generation loop cannot serve ("" when it can): it died, or it
        has work and has made no pass for longer than the stuck limit."""
        decoder = self.decoder
        if decoder is None:
            return ""
        if not decoder.alive:
            return f"the decode loop has died: {decoder.died or 'its thread ended'}"
        stuck = decoder.stuck_for()
        if stuck > self.config.limits.stuck_after_s:
            return (
                f"the decode loop is stuck: no pass for {stuck:.0f} s with "
                f"{decoder.pending_work()} requests running or waiting"
            )
        return ""

    # -- leases -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def using(self, name: str, *, keep_alive_s: float | None = None):
        """Lease a resident model for one request: loaded if needed, and never
        evicted while leased. The request's `keep_alive_s` (None: the model's
        own) is how long the model may stay idle after it: set as the lease
        is taken (what the engine's state then tells) and again as it ends,
        so that of requests that overlap, the last to end decides, as with
        Ollama's `keep_alive`."""
        model = await self.ensure_loaded(name)
        model.inflight += 1  # no await since the lookup: eviction cannot slip in
        model.last_used = time.monotonic()
        model.asked_keep_alive_s = keep_alive_s
        try:
            yield model
        finally:
            model.inflight -= 1
            model.last_used = time.monotonic()
            model.asked_keep_alive_s = keep_alive_s
            if model.inflight == 0:
                async with self._room:
                    self._room.notify_all()

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
        async with self._deciding:
            if name in self.models:
                return self.models[name]
            self.loading.add(name)
            try:
                await self._make_room(spec)
                return await self._load(spec)
            finally:
                self.loading.discard(name)

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

    # -- making room --------------------------------------------------------------

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
            estimate = (
                await loop.run_in_executor(
                    None, _estimate, spec, limits, None, self.config.backend
                )
                or 0.0
            )
        # On a GPU engine the weights and KV cache go to the cards: the host
        # needs only what an earlier load measured there.
        need = spec.measured_mib or (0.0 if on_device else estimate)
        need_device = (spec.measured_device_mib or estimate) if on_device else 0.0
        # A GGUF model that cannot have the cards to itself (or is told to
        # stay off them) loads partly offloaded: its layers take the cards'
        # free memory as it is (engines/backends/offload.py plans them) and
        # the host must hold the rest, at worst the whole model.
        partial = on_device and self._partly_offloaded(spec, need_device, device_free)
        if partial:
            if estimate is None:
                estimate = (
                    await loop.run_in_executor(
                        None, _estimate, spec, limits, None, self.config.backend
                    )
                    or 0.0
                )
            need, need_device = max(spec.measured_mib or 0.0, estimate), 0.0
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
                    if partial and budget.need > budget.room + budget.held:
                        raise ProtocolError(
                            ErrorCode.INSUFFICIENT_MEMORY,
                            f"{spec.name} fits nowhere: it needs about "
                            f"{budget.need:.0f} MiB; the GPU cards cannot hold "
                            "it, and the host can make at most "
                            f"{max(budget.room + budget.held, 0):.0f} MiB free "
                            "for the layers that would run on the CPU (margin "
                            f"{limits.memory_margin_mib} MiB)",
                        )
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

    def _partly_offloaded(
        self, spec: ModelSpec, need_device: float, device_free: float
    ) -> bool:
        """Whether a model on this GPU engine is planned to run partly on the
        CPU: a GGUF model whose `gpu_layers` say none, or (auto or a number)
        that needs more than the cards can hold with every other model gone;
        a transformers model that needs more than that (its device map
        offloads the rest), or on an engine whose cards torch does not use."""
        if spec.format == "transformers":
            if self.config.backend not in TORCH_GPU_BACKENDS:
                return True  # torch runs it on the CPU (a Vulkan engine)
            # Offloaded by accelerate's device map past each card's cap.
            held = sum(m.device_mib for m in self.models.values())
            room = device_free - self.config.limits.memory_margin_mib + held
            return need_device > room
        if spec.format != "gguf" or spec.gpu_layers == "all":
            return False
        if spec.gpu_layers == "none":
            return True
        held = sum(m.device_mib for m in self.models.values())
        room = device_free - self.config.limits.memory_margin_mib + held
        return need_device > room

    async def _device_free(self) -> float | None:
        """Free memory on this engine's cards (None: not a GPU engine, or no
        cards seen). Read off the loop: nvidia-smi may be slow."""
        if self.config.backend not in GPU_BACKENDS:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._device_memory.free_mib)

    # -- loading and unloading ----------------------------------------------------

    async def _load(self, spec: ModelSpec) -> ResidentModel:
        """Load off the loop (the engine answers `state` meanwhile), measure the
        memory it took, and start serving it."""
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{spec.name}")
        process = psutil.Process()
        before = process.memory_info().rss
        on_device = self.config.backend in GPU_BACKENDS
        cards_before = (
            await loop.run_in_executor(None, self._device_memory.cards)
            if on_device
            else None
        )
        device_before = (
            sum(card.used_mib for card in cards_before) if cards_before else None
        )
        # The cards' free memory now (after any eviction) plans the offload.
        cards = (
            await loop.run_in_executor(
                None,
                offload_cards,
                self._device_memory,
                visible_cards(self.config.backend),
            )
            if on_device
            else None
        )
        host_free = psutil.virtual_memory().available / 2**20
        log.info("loading %s from %s", spec.name, spec.path)
        try:
            backend = await loop.run_in_executor(
                executor,
                functools.partial(
                    load_backend,
                    spec,
                    self.config.backend,
                    self.config.limits,
                    cards=cards,
                    host_free_mib=host_free if on_device else None,
                ),
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
            cards_after = await loop.run_in_executor(None, self._device_memory.cards)
            device_after = sum(card.used_mib for card in cards_after)
            grown = max(device_after - device_before, 0.0)
            before = _card_use(cards_before)
            model.device_cards_mib = {
                card: used - before[card]
                for card, used in _card_use(cards_after).items()
                if card in before and used > before[card]
            }
            # A card that shows no growth (memory the runtime had reserved
            # earlier, or a card we cannot read) holds what we expected.
            model.device_mib = grown or spec.measured_device_mib or 0.0
        model.estimated_mib = await loop.run_in_executor(
            None,
            _estimate,
            spec,
            self.config.limits,
            getattr(backend, "plan", None),
            self.config.backend,
        )
        if device_before is not None and not model.device_mib:
            model.device_mib = model.estimated_mib or 0.0
        try:
            self._serve(model)
        except ProtocolError:
            await loop.run_in_executor(executor, backend.close)
            executor.shutdown(wait=False)
            raise
        self.models[spec.name] = model
        offload = getattr(backend, "offload", None)
        log.info(
            "loaded %s (%.0f MiB)%s",
            spec.name,
            memory_mib,
            f": {offload.reason}" if offload and on_device else "",
        )
        return model

    def _serve(self, model: ResidentModel) -> None:
        """Give a loaded model its decode runner or its micro-batcher."""
        limits, spec = self.config.limits, model.spec
        if isinstance(model.backend, GenerationBackend):
            if self.decoder is None:
                self.decoder = DecodeThread(
                    self._allowed, max_parallel=limits.max_parallel_requests
                )
            model.runner = GenerationRunner(
                model.backend,
                name=spec.name,
                queue_limit=limits.queue_limit,
                queue_timeout_s=limits.queue_timeout_s,
                decoder=self.decoder,
            )
            return
        # A cross-encoder's (query, document) pairs, or an embedder's texts.
        backend = model.backend
        if hasattr(backend, "score_counted"):
            process = backend.score_counted
        else:
            process = getattr(backend, "encode_counted", None) or backend.encode
        model.batcher = MicroBatcher(
            process,
            executor=model.executor,
            window_s=spec.batch_window_ms / 1000,
            max_batch_size=spec.max_batch_size,
            queue_timeout_s=limits.queue_timeout_s,
            allowed=self._allowed_async,
        )

    async def _unload(self, model: ResidentModel) -> None:
        self.models.pop(model.spec.name, None)
        if model.batcher is not None:
            await model.batcher.close()
        if model.runner is not None:
            # Running requests finish first; the decode thread then frees the
            # model. A stuck loop keeps it: bounded, so shutdown always ends.
            await asyncio.get_running_loop().run_in_executor(
                None, model.runner.close, DRAIN_TIMEOUT_S
            )
        model.executor.shutdown(wait=False)
        log.info("unloaded %s", model.spec.name)

    async def unload_drained(self, name: str) -> None:
        """Drain, then unload: requests in flight and those already queued for
        the model finish; a new request waits for the drain (up to its queue
        timeout) and then loads the model again."""
        async with self._deciding:
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

    async def unload_all(self) -> None:
        for model in list(self.models.values()):
            await self._unload(model)

    def keep_alive_set(self, name: str, keep_alive_s: float | None) -> bool:
        """Ask that a resident model stay idle at most `keep_alive_s` (as a
        request's keep-alive does; 0: unload it once idle). False when the
        model is not resident here."""
        model = self.models.get(name)
        if model is None:
            return False
        model.asked_keep_alive_s = keep_alive_s
        return True

    async def expire_idle(self) -> None:
        """Unload models idle for their keep-alive (keep_alive_limit) or longer."""
        now = time.monotonic()
        for model in list(self.models.values()):
            keep = model.keep_alive_limit()
            if (
                keep is not None
                and model.inflight == 0
                and now - model.last_used >= keep
            ):
                log.info("unloading %s: idle for %g s", model.spec.name, keep)
                await self._unload(model)
                async with self._room:
                    self._room.notify_all()

    def configure(self, limits: Limits) -> None:
        """Apply new limits and model settings to the resident models."""
        if self.decoder is not None:
            with self.decoder.wake:
                self.decoder.max_parallel = limits.max_parallel_requests
                self.decoder.wake.notify_all()
        for name, model in self.models.items():
            spec = self.config.models.get(name, model.spec)
            model.spec = spec
            if model.runner is not None:
                model.runner.queue_limit = limits.queue_limit
                model.runner.queue_timeout_s = limits.queue_timeout_s
                # Read by the decode thread at each admission.
                model.runner.backend.prompt_cache = spec.prompt_cache
                continue
            model.batcher.configure(
                window_s=spec.batch_window_ms / 1000,
                max_batch_size=spec.max_batch_size,
                queue_timeout_s=limits.queue_timeout_s,
            )
