"""The WebSocket chat (`/ws/chat/`): authentication, then any number of
streams on one socket, each by the client's id.

Protocol (JSON text messages; docs/using/websocket-chat.md):
- A socket with a logged-in session is ready at once. Any other must send
  `{"type": "auth", "key": "rh-..."}` first, within AUTH_TIMEOUT_S; anything
  else, a wrong key or silence closes it with 4401 and a reason (4429 for a
  client over its failed keys, 1013 while keys cannot be checked). Ready, the
  server says `{"type": "ready"}`.
- `chat` starts a stream (chat.streams), `cancel` stops one. The server sends
  `start`, `token`..., then `done` or `error`, each with the stream's id; then,
  for an answer that started, `stored` with its conversation's id.
- A malformed message gets an `error` with code `bad_request` (id null when
  it had none) and the socket stays open.
- A closed socket cancels its streams in the engines.
- A session socket's login is checked again every SESSION_CHECK_S: once its
  session is gone from the store (logged out, expired, flushed by a password
  change) or its user is inactive or deleted, the socket is closed with 4401
  and a reason, and its streams are cancelled.
"""

import asyncio
import contextlib
import json
import logging
from importlib import import_module
from typing import Any

from channels.auth import get_user
from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django import db
from django.conf import settings

from api import errors
from api.calls import spawn
from api.pipeline import authenticate
from api.services import DATABASE_OUTAGE

from .schemas import Auth, Cancel, Chat, client_message
from .streams import ChatStream

log = logging.getLogger("roundhouse.chat")

UNAUTHENTICATED = 4401  # like HTTP 401, in the range applications may use
THROTTLED = 4429
TRY_AGAIN_LATER = 1013


class ChatConsumer(AsyncWebsocketConsumer):
    """One chat socket; override `stream_class` to change how a stream runs."""

    stream_class = ChatStream
    # No channel layer: tokens come over the engine connection, and nothing is
    # sent to a chat socket from elsewhere. An alias that is not configured
    # gives none (channels.layers.get_channel_layer), so a socket costs no
    # channel and no receive loop on it (a Redis round trip each, with
    # channels_redis).
    channel_layer_alias = "chat-sockets-use-no-channel-layer"
    # Seconds a socket without a session has to send its key.
    AUTH_TIMEOUT_S = 5.0
    # Streams one socket may run at once.
    MAX_STREAMS = 16
    # Seconds between checks that a session socket's login still holds. On a
    # timer, not at each `chat`: a stream's way to its engine waits on no
    # query of it, and an idle socket of a user logged out is closed too.
    SESSION_CHECK_S = 5.0

    async def connect(self) -> None:
        self.streams: dict[str, ChatStream] = {}
        self.key = None
        self._presented_key: str | None = None
        self._closing = False
        self._auth_timer: asyncio.TimerHandle | None = None
        self._session_watch: asyncio.Task | None = None
        client = self.scope.get("client") or ("unknown", 0)
        self.client_address = client[0] or "unknown"
        user = self.scope.get("user")
        self.user = user if user is not None and user.is_authenticated else None
        await self.accept()
        if self.user is not None:
            self._session_watch = asyncio.ensure_future(self._watch_session())
            await self.send_message({"type": "ready", "user": self.user.get_username()})
            return
        self._auth_timer = asyncio.get_running_loop().call_later(
            self.AUTH_TIMEOUT_S,
            lambda: spawn(
                self._refuse(
                    UNAUTHENTICATED,
                    f"No authentication within {self.AUTH_TIMEOUT_S:g} s: send "
                    '{"type": "auth", "key": "..."} first, or log in.',
                ),
                "closing an unauthenticated socket",
            ),
        )

    async def dispatch(self, message: dict) -> None:
        """Channels' dispatch, less its closing of stale database connections
        before every message: a hop to the shared sync thread, on the way of
        every `chat` before its engine is asked. This consumer reaches the
        database only through `database_sync_to_async`, which does that
        itself."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def _watch_session(self) -> None:
        """Every SESSION_CHECK_S, whether the login still holds; once it does
        not, close the socket (4401) and cancel its streams. While the
        database fails, the socket stays as it is until a check can be made."""
        while not self._closing:
            await asyncio.sleep(self.SESSION_CHECK_S)
            try:
                holds = await self.login_holds()
            except db.Error as error:
                DATABASE_OUTAGE.failed("checking a chat socket's login", error)
                continue
            DATABASE_OUTAGE.worked()
            if not holds and not self._closing:
                await self._refuse(
                    UNAUTHENTICATED,
                    "Your login ended (logged out, expired or deactivated): "
                    "log in again.",
                )
                await self._streams_cancelled()
                return

    async def login_holds(self) -> bool:
        """Whether the socket's session is still in the session store, logged
        in as the same user, who is still active (what Django checks of a
        session at every request: Channels' get_user on the session as the
        store has it now, not as it was read when the socket opened)."""
        session_key = self.scope["session"].session_key
        if not session_key:
            return False
        store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        user = await get_user({"session": store})
        return user.is_authenticated and user.pk == self.user.pk and user.is_active

    @property
    def authenticated(self) -> bool:
        return self.user is not None or self.key is not None

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None
    ) -> None:
        if self._closing:
            return
        try:
            message = self._decoded(text_data)
        except errors.ApiError as error:
            if not self.authenticated:
                await self._refuse(UNAUTHENTICATED, error.message)
                return
            await self.send_message(error.websocket_message(_id_of(text_data)))
            return
        if not self.authenticated:
            if isinstance(message, Auth):
                await self._authenticate(message)
            else:
                await self._refuse(
                    UNAUTHENTICATED,
                    'Authenticate first: {"type": "auth", "key": "..."}, or log in.',
                )
            return
        if isinstance(message, Chat):
            await self._start(message)
        elif isinstance(message, Cancel):
            stream = self.streams.get(message.id)
            if stream is not None:  # one that already ended needs nothing
                stream.cancel()
        else:
            await self.send_message(
                errors.invalid_request(
                    "This socket is already authenticated."
                ).websocket_message(None)
            )

    def _decoded(self, text: str | None) -> Auth | Chat | Cancel:
        if text is None:
            raise errors.invalid_request("Messages are JSON text, not binary.")
        cap = settings.ROUNDHOUSE_MAX_REQUEST_BYTES
        if len(text) > cap:
            raise errors.too_large(len(text), cap)
        return client_message(text)

    async def _authenticate(self, auth: Auth) -> None:
        try:
            self.key = await authenticate(
                authorization=f"Bearer {auth.key}", client=self.client_address
            )
        except errors.ApiError as error:
            code = {429: THROTTLED, 503: TRY_AGAIN_LATER}.get(
                error.status, UNAUTHENTICATED
            )
            await self._refuse(code, error.message)
            return
        self._presented_key = auth.key
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        await self.send_message({"type": "ready", "key": self.key.name})

    async def _start(self, chat: Chat) -> None:
        if chat.id in self.streams:
            await self.send_message(
                errors.invalid_request(
                    f"A stream with id '{chat.id}' is still running.", param="id"
                ).websocket_message(chat.id)
            )
            return
        if len(self.streams) >= self.MAX_STREAMS:
            await self.send_message(
                errors.rate_limited(
                    f"At most {self.MAX_STREAMS} streams run at once on one socket.",
                    1,
                    code=errors.ApiCode.TOO_MANY_STREAMS,
                ).websocket_message(chat.id)
            )
            return
        stream = self.stream_class(
            chat,
            user=self.user,
            key=self.key,
            presented_key=self._presented_key,
            client=self.client_address,
            send=self.send_message,
        )
        self.streams[chat.id] = stream
        stream.start().add_done_callback(lambda _: self._forget(stream))

    def _forget(self, stream: ChatStream) -> None:
        if self.streams.get(stream.chat.id) is stream:
            del self.streams[stream.chat.id]

    async def send_message(self, message: dict[str, Any]) -> None:
        """Send one message; nothing once the socket is closing or closed."""
        if self._closing:
            return
        try:
            await self.send(text_data=json.dumps(message, separators=(",", ":")))
        except Exception as error:  # the socket went away under us
            log.debug("could not send on a chat socket: %s", error)

    async def _refuse(self, code: int, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        # The close reason is at most 123 bytes (RFC 6455).
        await self.close(
            code=code, reason=reason.encode()[:123].decode(errors="ignore")
        )

    async def disconnect(self, code: int) -> None:
        """The socket closed: cancel its streams (in their engines too)."""
        self._closing = True
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        if self._session_watch is not None:
            self._session_watch.cancel()
        await self._streams_cancelled()

    async def _streams_cancelled(self) -> None:
        """Cancel the socket's streams (in their engines too); wait for them."""
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _id_of(text: str | None) -> str | None:
    """The id of a message that was refused, when it had a usable one."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    found = data.get("id") if isinstance(data, dict) else None
    return found if isinstance(found, str) and len(found) <= 64 else None
