"""One answer streamed over a chat socket, from admission to its stored turn.

A `ChatStream` runs in a task of its own (one per stream id on a socket). It
goes through the REST API's own pipeline (api.pipeline): the caller's key
checked again (a key revoked while its socket is open stops working), the
body checked by the REST schema, the model, the key's limits, the engine; its
`Call` ends in one usage row (endpoint `ws.chat`). Tokens come over the engine
connection, through the relay REST's streams use too (api.token_relay), and leave as
`token` messages; the channel layer never sees them.

The answer's turn is stored once it has ended (`done` or `error` sent), and a
`stored` message then gives its conversation's id. A turn sent again with the
same `turn_id` (the chat page does after a reconnect) streams again and
replaces the stored answer of that turn rather than adding the turn twice.

Cancelling the task ends the stream: the call's end closes the engine stream,
which cancels the request in the engine and frees its slot. A cancel the client
asked for is answered with `done` and finish reason `cancelled`; a socket that
closed is answered with nothing.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from channels.db import database_sync_to_async

from api import errors
from api.calls import AFTER_FIRST_TOKEN_S, Call, after_answer
from api.choices import (
    call_requests,
    choices_open,
    engine_messages,
    tool_call_deltas,
    tool_calls,
)
from api.models import ApiKey
from api.pipeline import api_error, authenticate, call_admitted
from api.token_relay import Ended, Token, tokens_relayed

from .schemas import Chat, chat_request
from .selectors import conversations_owned
from .services import Answer, conversation_turn_record

log = logging.getLogger("roundhouse.chat")

Send = Callable[[dict[str, Any]], Awaitable[None]]


def _choice_end(end: Ended) -> dict:
    """How one of several choices ended (the `done` message lists them)."""
    return {
        "index": end.index,
        "finish_reason": end.reason,
        "tool_calls": tool_calls(end.frame.tool_calls or []),
    }


def _ms(since: float, until: float | None = None) -> float:
    return round(((until or time.perf_counter()) - since) * 1000, 3)


class ChatStream:
    """One `chat` message's answer; `run` it in a task, `cancel` it by id."""

    def __init__(
        self,
        chat: Chat,
        *,
        user: Any,
        key: ApiKey | None,
        presented_key: str | None,
        client: str,
        send: Send,
    ) -> None:
        self.chat = chat
        self.user = user
        self.key = key
        self._presented_key = presented_key
        self._client = client
        self._send = send
        self.call = Call("ws.chat", user=user)
        self.answer = Answer(model=chat.model)
        self._messages: list[dict] | None = None  # as sent to the engine
        self._parts: list[str] = []  # the answer's text so far
        self._started = False  # `start` was sent: the turn is stored
        self._ended = False
        self.cancel_asked = False
        self.task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self.task = asyncio.ensure_future(self.run())
        return self.task

    def cancel(self) -> None:
        """The client's cancel: the stream ends with `done`, `cancelled`."""
        if self.task is not None and not self.task.done():
            self.cancel_asked = True
            self.task.cancel()

    async def run(self) -> None:
        try:
            await self._answer()
        finally:
            if self._started:  # the turn is stored once the answer has ended
                await asyncio.shield(self._record())

    async def _answer(self) -> None:
        call = self.call
        try:
            await self._stream()
        except asyncio.CancelledError:
            if not self.cancel_asked:  # the socket closed: nobody to tell
                call.hung_up()
                self.answer.delivered = False
                await asyncio.shield(self._end())
                raise
            asyncio.current_task().uncancel()
            call.cancelled()
            self.answer.finish_reason = "cancelled"
            await asyncio.shield(self._end())
            await self._send(self._done("cancelled"))
            return
        except Exception as error:  # the engine failing mid-stream too
            failure = api_error(error, what="chat stream")
            call.failed_with(failure)
            self.answer.error_code = call.error_code
            await asyncio.shield(self._end())
            await self._send(failure.websocket_message(self.chat.id))

    async def _stream(self) -> None:
        call, chat = self.call, self.chat
        if self.key is not None:  # checked again: it may have been revoked
            key = await authenticate(
                authorization=f"Bearer {self._presented_key}", client=self._client
            )
            call.authenticated(key)
        request = chat_request(chat)
        if chat.conversation is not None:
            await self._check_conversation(chat.conversation)
        await call_admitted(call, request.model, weight=request.weight)
        requests = call_requests(request, "interactive", call=call)
        opened, usage_count = await choices_open(
            call, requests, per_prompt=request.choices_per_prompt
        )
        start = opened[0][1]
        self._messages = engine_messages(requests[0])
        self.answer.model, self.answer.engine = call.model, call.engine
        self._started = True
        # The oldest messages the model did not see: the conversation was
        # longer than its context and its context overflow setting drops them.
        await self._send(
            {
                "type": "start",
                "id": chat.id,
                "model": call.model,
                "engine": call.engine,
                "node": call.node,
                "dropped_messages": start.dropped_messages,
            }
        )
        # Several choices (`n`): each message names its choice's `index`; the
        # stored turn is the first choice's.
        several = len(opened) > 1
        ends: dict[int, Ended] = {}
        # Refresh the fleet snapshot and stale keys once the answer is under
        # way, as REST does.
        loop = asyncio.get_running_loop()
        relay = tokens_relayed(
            call,
            opened,
            usage_count,
            first_token=lambda: loop.call_later(AFTER_FIRST_TOKEN_S, after_answer),
        )
        # The call's end closes the engine streams: the relay must have
        # stopped reading them by then.
        self.call.held.push_async_callback(relay.aclose)
        async for event in relay:
            if isinstance(event, Token):
                frame = event.frame
                message = {"type": "token", "id": chat.id, "text": frame.text}
                if frame.tool_calls:
                    message["tool_calls"] = tool_call_deltas(frame.tool_calls)
                if frame.logprobs:
                    message["logprobs"] = [e.model_dump() for e in frame.logprobs]
                if several:
                    message["index"] = event.index
                if event.index == 0:
                    self._parts.append(frame.text)
                await self._send(message)
            elif isinstance(event, Ended):
                ends[event.index] = event
                if not event.last:
                    continue
                first = ends[0]
                self.answer.finish_reason = first.reason
                engine_timings = call.timings(first.frame)
                await self._end()
                done = self._done(first.reason, engine_timings)
                if first.frame.tool_calls:
                    done["tool_calls"] = tool_calls(first.frame.tool_calls)
                if several:
                    done["choices"] = [
                        _choice_end(end) for _, end in sorted(ends.items())
                    ]
                await self._send(done)
                return

    async def _check_conversation(self, pk: int) -> None:
        owned = conversations_owned(user=self.user, key=self.key).filter(pk=pk)
        if not await database_sync_to_async(owned.exists)():
            raise errors.from_mapping(
                errors.NOT_FOUND,
                f"No conversation {pk} of yours.",
                code=errors.ApiCode.CONVERSATION_NOT_FOUND,
                param="conversation",
            )

    async def _end(self) -> None:
        """End the call (engine stream closed, key slot back, usage queued)
        and take the answer's account; once."""
        if self._ended:
            return
        self._ended = True
        call = self.call
        await call.end()
        if call.first_token_at is None:
            # Refused or failed before any token: refresh what requests read
            # from memory now, as REST does after its answer (else, while an
            # engine is down, the fleet snapshot stays as it was until it is
            # too old to use, and every stream meanwhile is refused).
            after_answer()
        self.answer.content = "".join(self._parts)
        self.answer.prompt_tokens = call.prompt_tokens
        self.answer.completion_tokens = call.completion_tokens
        if call.first_token_at is not None:
            self.answer.first_token_ms = _ms(call.started, call.first_token_at)
        self.answer.total_ms = _ms(call.started)

    async def _record(self) -> None:
        """Store the turn, then tell the client where (`stored`): after its
        `done` (or `error`), which thus never waits for the database."""
        try:
            stored = await database_sync_to_async(conversation_turn_record)(
                user=self.user,
                key=self.key,
                conversation=self.chat.conversation,
                messages=self._messages or [],
                regenerate=self.chat.regenerate,
                answer=self.answer,
                turn_id=self.chat.turn_id or "",
            )
        except Exception:  # the answer reached the caller: keep serving
            log.exception("could not store a chat turn")
            return
        await self._send(
            {"type": "stored", "id": self.chat.id, "conversation": stored.pk}
        )

    def _done(self, reason: str, engine_timings: dict | None = None) -> dict:
        return {
            "type": "done",
            "id": self.chat.id,
            "finish_reason": reason,
            "usage": self.call.usage(),
            "timings": {
                **(engine_timings or {"engine": self.call.engine}),
                "first_token_ms": self.answer.first_token_ms,
                "total_ms": self.answer.total_ms,
            },
        }
