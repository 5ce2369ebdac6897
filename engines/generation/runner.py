"""Continuous batching for generation models: the backend interface, requests,
and the one decode thread per model that runs them."""

import abc
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engines.generation.handoff import Handoff
from engines.generation.sampling import SamplingParams
from engines.wire.errors import ErrorCode, ProtocolError

log = logging.getLogger("roundhouse.engine.generation")

_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    """One generation: its prompt tokens, sampling, and where its events go.

    `emit` is called from the decode thread with event dicts: {"event":
    "admitted", "prompt_tokens": n} once it has a slot, then {"event": "token",
    "text": ..., "tokens": n} any number of times, then exactly
    one {"event": "done", "finish_reason": ..., "usage": {...}} or
    {"event": "error", "code": ..., "message": ...}.
    """

    prompt_tokens: list[int]
    params: SamplingParams
    emit: Callable[[dict[str, Any]], None]
    id: str = field(default_factory=lambda: f"gen-{next(_ids)}")
    queued_at: float = field(default_factory=time.monotonic)
    finished: bool = False
    # A batch line (priority "batch"): it yields to interactive requests.
    background: bool = False
    # Who asked (the front's id of the caller; "" for none: a caller of its
    # own). Free slots go first to the callers with the fewest in slots.
    caller: str = ""
    # Whose prompt cache it may use (GenerateRequest.cache_salt; "": the
    # cache of every request without a salt).
    cache_salt: str = ""
    # The grammar the answer is held to (an llguidance matcher,
    # engines/constrained/grammar.py), and whether tool calls are read out of it.
    matcher: Any = None
    tool_calls: bool = False
    # The prompt's own log-probabilities (completions' echo with logprobs):
    # its whole prompt is evaluated, none of it taken from a cache.
    prompt_logprobs: bool = False

    def finish(self, event: dict[str, Any]) -> None:
        """Deliver the final event once (later calls are ignored)."""
        if not self.finished:
            self.finished = True
            self.emit(event)


class GenerationBackend(abc.ABC):
    """What the decode thread needs of a model (llama.cpp, transformers).

    A backend owns `n_slots` sessions created at load: weights are shared, while
    each slot's KV cache, sampler, RNG and stream state are private. All methods
    but `tokenize` and `render_prompt` run on the decode thread only.
    """

    n_slots: int

    @abc.abstractmethod
    def render_prompt(self, message: dict[str, Any]) -> str:
        """The prompt text of a request (`prompt`, or `messages` through the chat
        template); bad_request when the model cannot serve it."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def free_slots(self) -> int: ...

    @abc.abstractmethod
    def admit(self, request: GenerationRequest) -> None:
        """Put a request into a free slot (its prompt is evaluated by step())."""

    @abc.abstractmethod
    def active(self) -> int:
        """Slots with a request in them."""

    @abc.abstractmethod
    def step(self) -> None:
        """One batched forward pass over every active slot; emits events and frees
        the slots whose requests ended."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> bool:
        """End a request now with finish reason `cancelled`; its slot is freed."""

    @abc.abstractmethod
    def running_ids(self) -> set[str]:
        """Ids of the requests in slots now."""

    @abc.abstractmethod
    def fail_running(self, code: str, message: str) -> None:
        """End every request in a slot with an error; the slots are freed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the model and every slot."""


class DecodeThread:
    """The engine's one decode thread: it steps every generation model in turn.

    Every llama_decode (or forward pass) of the engine happens on this thread, so
    two models never run compute-bound work at once and oversubscribe the cores.
    It sleeps on a condition when no model has work (no polling).

    It cannot be stopped by a request: an exception from one model's admission or
    step fails that model's requests in it (`GenerationRunner.tick`), and an
    exception that escapes anyway is recorded in `died` with every request
    failed, so that the engine reports itself unhealthy instead of hanging.
    `progress_at` moves on every pass of the loop (cooling included), so work
    pending with no pass for a long time means the loop is stuck.
    """

    def __init__(
        self, allowed: threading.Event | None = None, *, max_parallel: int = 4
    ) -> None:
        self.wake = threading.Condition()
        self.runners: list[GenerationRunner] = []
        # Cleared while the engine cools: the step in progress finishes, no new
        # step starts, new requests wait in their queues.
        self.allowed = allowed or threading.Event()
        if allowed is None:
            self.allowed.set()
        # Requests this engine runs at once, across its models (admin: max
        # parallel requests); admission happens on this thread only.
        self.max_parallel = max_parallel
        self.died: str = ""  # why the loop ended, if it ever does
        # Events for the event loop, handed over once per pass.
        self.handoff = Handoff()
        self.progress_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    def parallel_left(self) -> int:
        """Requests that may still start now under max_parallel."""
        running = sum(runner.backend.active() for runner in self.runners)
        return max(self.max_parallel - running, 0)

    def add(self, runner: "GenerationRunner") -> None:
        with self.wake:
            if self.died:
                raise ProtocolError(
                    ErrorCode.INTERNAL, f"the decode loop has died: {self.died}"
                )
            self.runners.append(runner)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.died

    def pending_work(self) -> int:
        """Requests running or waiting in any model (read without the lock: a
        health check must not wait for a stuck loop)."""
        return sum(runner.queued + runner.busy for runner in list(self.runners))

    def stuck_for(self) -> float:
        """Seconds since the loop's last pass while it had work; 0 when idle."""
        if not self.pending_work():
            return 0.0
        return max(time.monotonic() - self.progress_at, 0.0)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # recorded, then reported: never silent
            log.exception("the decode loop died")
            self.died = f"{type(error).__name__}: {error}"
            for runner in list(self.runners):
                runner.fail_all(f"the engine's decode loop died: {self.died}")

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not any(runner.has_work() for runner in self.runners):
                    self.progress_at = time.monotonic()
                    self.wake.wait()
                runners = list(self.runners)
            self.progress_at = time.monotonic()
            allowed = self.allowed.is_set()
            for runner in runners:
                if runner.tick(step=allowed):  # closed: its model is freed here
                    with self.wake:
                        self.runners.remove(runner)
                self.progress_at = time.monotonic()
            if not allowed:
                self.allowed.wait(0.5)  # cooling: cancels are still handled


class DecodeRate:
    """A model's measured speed: the tokens it generated per second of its
    decode steps (prompt evaluation included) over the last `window_s` seconds
    of steps; None before its first token. Tokens are counted and steps timed
    on the decode thread; any thread reads `per_s`."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._tokens = 0  # since the last step ended
        # (when a step ended, its seconds, the tokens it generated)
        self._steps: deque[tuple[float, float, int]] = deque()

    def counted(self, tokens: int) -> None:
        self._tokens += tokens

    def stepped(self, seconds: float) -> None:
        now = time.monotonic()
        self._steps.append((now, seconds, self._tokens))
        self._tokens = 0
        while self._steps and now - self._steps[0][0] > self.window_s:
            self._steps.popleft()

    def per_s(self) -> float | None:
        steps = list(self._steps)  # a copy: the decode thread appends
        tokens = sum(step[2] for step in steps)
        seconds = sum(step[1] for step in steps)
        if not tokens or seconds <= 0:
            return None
        return tokens / seconds


class GenerationRunner:
    """Admission and stepping for one generation model: FIFO admission of queued
    requests into free slots, cancels, then one decode step of its running slots;
    requests join or leave the running batch between steps. Runs on the engine's
    DecodeThread.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        *,
        name: str,
        queue_limit: int,
        queue_timeout_s: float,
        decoder: DecodeThread,
    ) -> None:
        self.backend = backend
        self.name = name
        self.queue_limit = queue_limit
        self.queue_timeout_s = queue_timeout_s
        self._decoder = decoder
        self._wake = decoder.wake
        self._pending: deque[GenerationRequest] = deque()
        self._cancels: set[str] = set()
        self._known: set[str] = set()
        # Requests in slots that named their caller: request id -> caller.
        self._callers: dict[str, str] = {}
        self._stopping = False
        self._closed = threading.Event()
        self.steps = 0
        self.rate = DecodeRate()
        decoder.add(self)

    # -- called from the event loop ------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request, or refuse it at once when the queue is full (or, with
        a queue timeout of zero, when no slot is free right now)."""
        with self._wake:
            if self._stopping:
                raise ProtocolError(ErrorCode.CANCELLED, "model is unloading")
            if not self._decoder.alive:
                raise ProtocolError(
                    ErrorCode.INTERNAL,
                    f"this engine cannot generate: the decode loop has died "
                    f"({self._decoder.died or 'its thread ended'})",
                )
            if self.queue_timeout_s <= 0 and (
                self._pending
                or not self.backend.free_slots()
                or not self._decoder.parallel_left()
            ):
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    f"no free slot for {self.name} now (queue timeout is 0)",
                )
            if len(self._pending) >= self.queue_limit:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    f"{len(self._pending)} requests already wait for {self.name}",
                )
            request.emit = self._counting(request.emit)
            self._pending.append(request)
            self._known.add(request.id)
            self._wake.notify_all()

    def cancel(self, request_id: str) -> bool:
        """Ask for a request to end; True when this runner knows it."""
        with self._wake:
            if request_id not in self._known:
                return False
            self._cancels.add(request_id)
            self._wake.notify_all()
            return True

    @property
    def handoff(self) -> Handoff:
        """How this model's events reach an event loop (its decode thread's)."""
        return self._decoder.handoff

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> int:
        return self.backend.active()

    def close(self, timeout: float | None = None) -> bool:
        """Finish running requests, refuse queued ones, free the model (blocks,
        up to `timeout`). True once freed. With the decode loop dead, the model
        is freed here; with it stuck, it is left as it is (freeing it under a
        step in progress would crash the process) and False returned."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._closed.wait(0.5):
            if not self._decoder.alive:
                self.fail_all("the model is unloading")
                self.backend.close()
                self._closed.set()
                break
            if deadline is not None and time.monotonic() > deadline:
                log.error("%s did not close in %g s: left as it is", self.name, timeout)
                return False
        return True

    def fail_all(self, message: str) -> None:
        """End every request of this model, running or queued, with an error."""
        with self._wake:
            refused, self._pending = list(self._pending), deque()
        for request in refused:
            request.finish(
                {"event": "error", "code": ErrorCode.INTERNAL, "message": message}
            )
        try:
            self.backend.fail_running(ErrorCode.INTERNAL.value, message)
        except Exception:
            log.exception("failing the requests of %s failed", self.name)

    # -- on the decode thread ------------------------------------------------------

    def has_work(self) -> bool:
        """Something to do now (caller holds the lock)."""
        return bool(
            self._stopping
            or self._cancels
            or (
                self._pending
                and self.backend.free_slots()
                and self._decoder.parallel_left()
            )
            or self.backend.active()
        )

    def tick(self, *, step: bool = True) -> bool:
        """Cancel, admit and run one step (only cancels while `step` is False,
        unless the model is closing). True once closed and freed.

        A failure stays with its requests: a request whose admission raises is
        answered with the error alone; a step that raises ends the requests in
        that step (their KV state is unknown) and the model goes on serving.
        """
        step = step or self._stopping
        with self._wake:
            cancels, self._cancels = self._cancels, set()
            admitted = self._take_admissible() if step else []
            refused: list[GenerationRequest] = []
            if self._stopping:
                refused, self._pending = list(self._pending), deque()
        for request in refused:
            request.finish(
                {
                    "event": "error",
                    "code": ErrorCode.CANCELLED,
                    "message": "model unloading",
                }
            )
        try:
            for request_id in cancels:
                if not self._cancel_queued(request_id):
                    self.backend.cancel(request_id)
        except Exception as error:
            log.exception("cancelling in %s failed", self.name)
            self.fail_all(f"cancelling failed: {describe_error(error)}")
        for request in admitted:
            try:
                self.backend.admit(request)
            except Exception as error:
                log.exception("admitting %s to %s failed", request.id, self.name)
                request.finish(_error_event(error, "admitting the request failed"))
                continue
            if not request.finished:  # in a slot: no queue timeout can reach it
                request.emit(
                    {"event": "admitted", "prompt_tokens": len(request.prompt_tokens)}
                )
        if step and self.backend.active():
            started = time.perf_counter()
            try:
                with self.handoff.holding():
                    self.backend.step()
            except Exception as error:
                log.exception("decode step of %s failed", self.name)
                self.backend.fail_running(
                    ErrorCode.INTERNAL.value,
                    f"the decode step failed: {describe_error(error)}",
                )
            self.steps += 1
            self.rate.stepped(time.perf_counter() - started)
        self._forget_finished()
        if self._stopping and not self.backend.active():
            self.backend.close()
            self._closed.set()
            return True
        return False

    def _counting(
        self, emit: Callable[[dict[str, Any]], None]
    ) -> Callable[[dict[str, Any]], None]:
        """`emit`, counting the tokens its events carry into the model's rate."""

        def counted(event: dict[str, Any]) -> None:
            if event.get("event") == "token":
                self.rate.counted(int(event.get("tokens") or 1))
            emit(event)

        return counted

    def _take_admissible(self) -> list[GenerationRequest]:
        """Refuse every queued interactive request past its queue timeout
        (whether or not a slot is free; a batch request waits as long as it
        must, its worker keeping few in the queue), then admit the oldest
        ones into the free slots, interactive requests before batch ones
        (interactive ones shared fairly between callers: `_fairly`); batch
        requests leave a quarter of the slots free, so that an interactive
        request never waits behind them for a slot (caller holds the lock)."""
        if self.queue_timeout_s > 0 and self._pending:
            now = time.monotonic()
            overdue = [
                request
                for request in self._pending
                if not request.background
                and now - request.queued_at > self.queue_timeout_s
            ]
            for request in overdue:
                self._pending.remove(request)
                request.finish(
                    {
                        "event": "error",
                        "code": ErrorCode.OVERLOADED,
                        "message": f"waited more than {self.queue_timeout_s:g} s",
                    }
                )
        free = min(self.backend.free_slots(), self._decoder.parallel_left())
        if not free or not self._pending:
            return []
        taken = self._fairly([r for r in self._pending if not r.background], free)
        background_room = self.backend.free_slots() - len(taken) - self._reserve()
        if background_room > 0 and len(taken) < free:
            room = min(background_room, free - len(taken))
            taken += [r for r in self._pending if r.background][:room]
        for request in taken:
            self._pending.remove(request)
            if request.caller:
                self._callers[request.id] = request.caller
        return taken

    def _fairly(
        self, waiting: list[GenerationRequest], count: int
    ) -> list[GenerationRequest]:
        """Up to `count` of the waiting requests: each in turn the oldest of
        the caller with the fewest requests in slots (those already taken
        included), so that one caller's many choices cannot hold every slot
        while others wait; FIFO among equals, and among requests with no
        caller."""
        held = Counter(self._callers.values())
        taken: list[GenerationRequest] = []
        left = list(waiting)
        while left and len(taken) < count:
            best = min(
                range(len(left)),
                key=lambda i: (held[left[i].caller] if left[i].caller else 0, i),
            )
            request = left.pop(best)
            if request.caller:
                held[request.caller] += 1
            taken.append(request)
        return taken

    def _reserve(self) -> int:
        """Slots that batch requests leave free for interactive ones."""
        return min(self.backend.n_slots, self._decoder.max_parallel) // 4

    def _cancel_queued(self, request_id: str) -> bool:
        with self._wake:
            for request in self._pending:
                if request.id == request_id:
                    self._pending.remove(request)
                    request.finish(
                        {
                            "event": "done",
                            "finish_reason": "cancelled",
                            "usage": {
                                "prompt_tokens": len(request.prompt_tokens),
                                "completion_tokens": 0,
                            },
                        }
                    )
                    return True
        return False

    def _forget_finished(self) -> None:
        running = self.backend.running_ids()
        with self._wake:
            waiting = {request.id for request in self._pending}
            self._known &= waiting | running
            for request_id in set(self._callers) - running:
                del self._callers[request_id]


def describe_error(error: BaseException) -> str:
    """An exception in a few words for an error frame (the log has the rest)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def _error_event(error: BaseException, context: str) -> dict[str, Any]:
    """The final event for a request that an exception ended: its own code for
    a ProtocolError (bad_request where the input was at fault), else internal."""
    if isinstance(error, ProtocolError):
        return {"event": "error", "code": error.code.value, "message": error.message}
    return {
        "event": "error",
        "code": ErrorCode.INTERNAL.value,
        "message": f"{context}: {describe_error(error)}",
    }
