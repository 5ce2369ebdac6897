"""One API request's bookkeeping, and the relay of a stream's body.

A `Call` becomes the request's usage row and metrics, and holds what the request
holds until it ends (its key's concurrency slot, its engine stream). A stream's
body is a `StreamBody`, which ends its call however the stream ends. Work for later
(refreshing the fleet snapshot and stale keys) starts once an answer is under
way, in tasks whose failures are logged, never left unretrieved.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from django.http import HttpResponse

from engines.wire.errors import ErrorCode
from engines.wire.replies import Ending, Usage
from routing.select import ModelRoute, Snapshot

from . import errors, metrics, services, usage
from .gateway import front_gateway
from .models import ApiKey

log = logging.getLogger("roundhouse.api")

# How long after a stream's first token its background refreshes start.
AFTER_FIRST_TOKEN_S = 0.1
# Background work started after a request reached its engine; referenced here
# until done (the event loop keeps only weak references to tasks).
_background: set[asyncio.Task] = set()


@dataclass
class Call:
    """One API request's bookkeeping: becomes its usage row and metrics."""

    endpoint: str
    key: ApiKey | None = None
    # A logged-in user's call (the WebSocket chat) has no key.
    user: Any = None
    # A batch line: admitted in its key's batch budget (api.limits).
    batch: bool = False
    # Whose limits admitted it (api.limits.Allowance.scope); engines share
    # their slots fairly between callers.
    caller: str = ""
    model: str = ""
    # The model's route and the fleet its engine is chosen from, as the
    # pipeline found them (api.pipeline.model_route).
    route: ModelRoute | None = None
    snapshot: Snapshot | None = None
    engine: str = ""
    node: str = ""  # the engine's node ("" on a one-host platform)
    # A chat's message prefixes (routing.affinity.prefix_keys): the engine
    # whose prompt cache holds the longest is preferred.
    prefixes: tuple[str, ...] = ()
    # The model lets callers share one another's prompt cache
    # (ModelRoute.share_prompt_cache, set by pipeline.model_route); else each
    # key or user has its own (`cache_scope`).
    share_prompt_cache: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens the engine took from a slot's cache instead of evaluating.
    cached_tokens: int = 0
    # What the engine waited for the model to be loaded (its reply's load_ms;
    # 0: it was resident).
    load_ms: float = 0.0
    status: int = 200
    error_code: str = ""
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # What the request holds until it ends: its key's concurrency slot, its
    # engine stream.
    held: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    ended: bool = False

    def authenticated(self, key: ApiKey) -> None:
        """The caller is this live key (api.pipeline.authenticate's); the one
        place the call's key is written after it is built."""
        self.key = key

    def failed_with(self, error: errors.ApiError) -> None:
        """Record the failure the caller is told (its status, and its code or,
        without one, its type), however the transport frames it."""
        self.status, self.error_code = error.status, error.code or error.type

    def failed(self, error: errors.ApiError) -> HttpResponse:
        """Record the failure (`failed_with`) and answer it as HTTP."""
        self.failed_with(error)
        return error.response()

    @property
    def cache_scope(self) -> str:
        """Whose prompt cache the call may use and fill: its API key's or its
        user's (one cache per caller: a cached prefix, by its speed, its
        cached_tokens or where it is routed, would tell one caller what
        another sent), or "" (shared by all) where the model allows sharing."""
        if self.share_prompt_cache:
            return ""
        if self.key is not None:
            return f"key:{self.key.pk}"
        if self.user is not None:
            return f"user:{self.user.pk}"
        return ""

    def hung_up(self) -> None:
        """The caller went away (an error already recorded stays)."""
        if self.status < 400:
            self.status, self.error_code = 499, errors.ApiCode.CLIENT_CLOSED

    def cancelled(self) -> None:
        """The caller asked to stop the answer (the WebSocket chat's cancel)."""
        self.status, self.error_code = 499, ErrorCode.CANCELLED

    def usage(self) -> dict[str, int]:
        """The answer's `usage` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def counted(self, usage: Usage) -> None:
        """Take the engine's count of the request's tokens (the one place
        they are written: the prompts' at a stream's start, then the final
        count; a stream's completion tokens also as they come, `generated`)."""
        self.prompt_tokens = usage.prompt_tokens
        self.completion_tokens = usage.completion_tokens
        self.cached_tokens = usage.cached_tokens

    def generated(self, tokens: int) -> None:
        """A stream's next tokens: counted as they come (a stream cut short
        gets no final count), until the engine's final count replaces them."""
        # Built unvalidated: per token frame, from counts already checked.
        self.counted(
            Usage.model_construct(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens + tokens,
                cached_tokens=self.cached_tokens,
            )
        )

    def timings(self, reply: Ending) -> dict:
        """Which engine answered, and its own times from the request's arrival
        (Roundhouse's addition to OpenAI's shape, like llama.cpp server's
        `timings`): what the front and the network add is the rest."""
        return {
            "engine": self.engine,
            "node": self.node,
            "engine_first_token_ms": reply.timings.first_token_ms,
            "engine_total_ms": reply.timings.total_ms,
        }

    async def end(self) -> None:
        """Release what the request holds, then `finish` it; once."""
        if self.ended:
            return
        self.ended = True
        try:
            await self.held.aclose()
        finally:
            self.finish()

    def finish(self) -> None:
        """Count the request and queue its usage row (never raises)."""
        latency = time.perf_counter() - self.started
        model = self.model or "-"
        metrics.REQUESTS.labels(
            self.endpoint, model, self.engine or "-", str(self.status)
        ).inc()
        metrics.LATENCY.labels(self.endpoint, model).observe(latency)
        if self.first_token_at is not None:
            metrics.TIME_TO_FIRST_TOKEN.labels(model).observe(
                self.first_token_at - self.started
            )
        for kind, count in (
            ("prompt", self.prompt_tokens),
            ("prompt_cached", self.cached_tokens),
            ("prompt_evaluated", self.prompt_tokens - self.cached_tokens),
            ("completion", self.completion_tokens),
        ):
            if count:
                metrics.TOKENS.labels(model, self.engine or "-", kind).inc(count)
        if self.key is None and self.user is None:
            return  # refused before the caller was known: metrics only
        try:
            usage.usage_enqueue(
                key=self.key,
                user=self.user,
                model=self.model,
                engine=self.engine,
                node=self.node,
                endpoint=self.endpoint,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
                latency_ms=round(latency * 1000, 3),
                status=self.status,
                error_code=self.error_code,
            )
        except Exception:  # the answer is already sent; keep serving
            log.exception("could not record usage")


def spawn(work: Coroutine[Any, Any, None], what: str) -> asyncio.Task:
    """Run `work` in the background: referenced until done, its failure logged
    (an exception nobody retrieves is only reported when the task is garbage
    collected, as "Task exception was never retrieved")."""
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
    task.add_done_callback(lambda done: _log_failure(done, what))
    return task


def _log_failure(done: asyncio.Task, what: str) -> None:
    if not done.cancelled() and (failure := done.exception()) is not None:
        log.error("%s failed", what, exc_info=failure)


def after_answer() -> None:
    """Refresh what requests read from memory (the fleet snapshot, stale keys)
    in the background, once this request's answer has started: that work then
    does not delay it."""
    front_gateway().refresh_later()
    if services.stale_keys_waiting():
        spawn(services.api_keys_revalidate(), "reading API keys again")


class StreamBody:
    """A stream's body: relays its chunks, and ends its call (gives back the
    key's slot, hangs up on the engine, records usage) however the stream ends:
    its last chunk, an engine failure, the caller hanging up mid-stream, or the
    response closed before its body was read (the caller hung up between the
    headers and the first token, while the headers were being sent). Django
    closes a response whatever became of it, and calls `close` on its body."""

    def __init__(self, content: AsyncGenerator[bytes, None], call: Call) -> None:
        self._content = content
        self._call = call
        self._loop = asyncio.get_running_loop()
        self._chunks = self._relay()

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        return self._chunks

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        # The background refreshes start a moment after the first token: not
        # while the engine computes the prompt (on a host whose cores the engine
        # fills, work done then delays the first token), nor with it: streams
        # that started together get their first tokens together, and a refresh
        # started by the first of them would hold the GIL while the front
        # relays the others.
        refreshed = False
        try:
            async for chunk in self._content:
                yield chunk
                if not refreshed and self._call.first_token_at is not None:
                    refreshed = True
                    self._loop.call_later(AFTER_FIRST_TOKEN_S, after_answer)
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled while waiting for the engine, or closed while a chunk
            # was being sent: the caller went away.
            self._call.hung_up()
            raise
        finally:
            if not refreshed:
                after_answer()
            try:
                await self._content.aclose()  # left at a chunk: its engine too
            finally:
                await asyncio.shield(self._call.end())

    def close(self) -> None:
        """Django is done with the response: end a stream that did not end
        (maybe from another thread)."""
        if not self._call.ended:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                self._loop.call_soon_threadsafe(self._abandoned)

    def _abandoned(self) -> None:
        spawn(self._end_abandoned(), "ending an abandoned stream")

    async def _end_abandoned(self) -> None:
        await self._chunks.aclose()  # if it started, its `finally` ends the call
        if not self._call.ended:  # it never started
            self._call.hung_up()
            await self._call.end()
