"""The API's ASGI handler (`/v1/`, `/healthz`, `/metrics`; roundhouse/asgi.py
routes those paths here): Django's ASGIHandler with no middleware. Those
middlewares (sessions, CSRF, auth, messages, clickjacking) mean nothing to
key-authenticated JSON, and each sync-style one costs a thread hop per request
on the way in and out: milliseconds before a stream's first token.

It leans on Django's handler where Django offers no public hook: every name it
uses or sets is listed in DJANGO_INTERNALS, and tests/platform/test_django_internals.py
checks each against the installed Django, so an upgrade that changes one fails
there first, by name. What it needs of the apps (the Batch API's upload check)
is passed in (UploadCheck), not imported."""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpResponse

from api import errors

# (class, attribute, what this module does with it, its parameters as this
# module calls it: None for an attribute it only sets).
DJANGO_INTERNALS = (
    (ASGIHandler, "handle", "overridden", ("self", "scope", "receive", "send")),
    (ASGIHandler, "read_body", "called", ("self", "receive")),
    (ASGIHandler, "create_request", "called", ("self", "scope", "body_file")),
    (ASGIHandler, "send_response", "called", ("self", "response", "send")),
    (ASGIHandler, "listen_for_disconnect", "called", ("self", "receive")),
    (ASGIHandler, "run_get_response", "called", ("self", "request")),
    (ASGIHandler, "load_middleware", "overridden", ("self", "is_async")),
    (ASGIHandler, "_get_response_async", "wrapped", ("self", "request")),
    (ASGIHandler, "_middleware_chain", "set", None),
    (ASGIHandler, "_view_middleware", "set", None),
    (ASGIHandler, "_template_response_middleware", "set", None),
    (ASGIHandler, "_exception_middleware", "set", None),
)


@dataclass(frozen=True)
class UploadCheck:
    """A path whose POST bodies are uploads: capped at `max_bytes()` (read
    when asked: settings may change) instead of the request cap, and
    `refusal` (the app's key and quota checks) asked with the declared size
    before any of the body is read (an HttpResponse to refuse, None to read
    it)."""

    path: str
    max_bytes: Callable[[], int]
    refusal: Callable[..., Awaitable[HttpResponse | None]]

    def matches(self, scope) -> bool:
        return scope.get("path") == self.path and scope.get("method") == "POST"

    def cap(self) -> int:
        return self.max_bytes()


class BareASGIHandler(ASGIHandler):
    """Django's ASGI handler with no middleware: URL resolution, then the view.

    Nor does it give each request its own ThreadSensitiveContext: Django's
    handler does, so every request starts a new thread (and database connection)
    just to send `request_started`. Nor does it send `request_started` at all:
    its receivers are synchronous, so Django sends it with a thread hop (0.4 ms
    measured, before the engine is asked); and it closes the response (which
    sends `request_finished`) on the event loop, whose thread holds no database
    connection, instead of in a thread. What `request_started` does that matters
    here, retiring broken or expired database connections, the API's database
    calls do themselves (api.selectors.in_db_thread): the views keep database
    work off their path, and what little there is runs in asgiref's one shared
    sync thread."""

    def __init__(
        self,
        *,
        upload: UploadCheck | None = None,
        framing: Callable[[str], Callable[[errors.ApiError], HttpResponse]]
        | None = None,
    ) -> None:
        super().__init__()
        self.upload = upload
        # How a path frames a refusal made here (an API dialect's error
        # shape); by default OpenAI's.
        self.framing = framing

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"the API serves HTTP only, not {scope['type']}")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send) -> None:
        """Read the body (refused over the size cap: from its Content-Length
        before any of it is read, else as soon as it goes over), answer, and
        cancel the answer if the client hangs up first (the view's stream then
        cancels its engine request)."""
        cap = settings.ROUNDHOUSE_MAX_REQUEST_BYTES
        upload = self.upload if self.upload and self.upload.matches(scope) else None
        if upload is not None:
            cap = upload.cap()
        try:
            declared = _content_length(scope)
            if declared is not None and declared > cap:
                raise errors.too_large(declared, cap)
            if upload is not None and declared is not None:
                # Its key and the storage quotas, before the body is read.
                refusal = await upload.refusal(
                    authorization=_header(scope, b"authorization"),
                    client=(scope.get("client") or ("unknown",))[0],
                    declared=declared,
                )
                if refusal is not None:
                    await self.send_response(refusal, send)
                    return
            body_file = await self.read_body(_capped(receive, cap))
        except RequestAborted:
            return
        except errors.ApiError as refused:
            framed = self.framing(scope.get("path", "")) if self.framing else None
            response = framed(refused) if framed else refused.response()
            await self.send_response(response, send)
            return
        try:
            request, refusal = self.create_request(scope, body_file)
            if request is None:
                await self.send_response(refusal, send)
                return
            await self._answer_unless_hung_up(request, receive, send)
        finally:
            body_file.close()

    async def _answer_unless_hung_up(self, request, receive, send) -> None:
        """Answer in this task, which a hang-up cancels. Django runs the answer
        in a task of its own and waits for it or the hang-up, whichever comes
        first: a loop pass more before the view starts, so in a burst of
        requests every one's engine request waits behind the others' arrival."""
        answering = asyncio.current_task()
        listening = True

        def hung_up(_: asyncio.Task) -> None:
            if listening:  # not once the answer is over (the end reads as one)
                answering.cancel()

        hangup = asyncio.create_task(self.listen_for_disconnect(receive))
        hangup.add_done_callback(hung_up)
        try:
            await self._answer(request, send)
        except asyncio.CancelledError:
            if not hangup.done():
                raise  # cancelled from outside: the server is stopping
            answering.uncancel()  # ours: the caller went away
        finally:
            listening = False
            hangup.cancel()
            with contextlib.suppress(asyncio.CancelledError, RequestAborted):
                await hangup

    async def _answer(self, request, send) -> None:
        response = await self.run_get_response(request)
        try:
            await self.send_response(response, send)
        finally:
            response.close()

    def load_middleware(self, is_async: bool = False) -> None:
        """No middleware: the chain is the view's response, with Django's
        conversion of exceptions to responses (see DJANGO_INTERNALS)."""
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)


def _header(scope, name: bytes) -> str | None:
    """A request header's value (latin-1, as HTTP headers are)."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _content_length(scope) -> int | None:
    """The declared body size; None when not declared."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise errors.invalid_request(
                    "Content-Length is not a number."
                ) from None
    return None


def _capped(receive, cap: int):
    """`receive`, raising 413 once the body read so far is over `cap` bytes (a
    chunked body declares no size)."""
    read = 0

    async def capped_receive():
        nonlocal read
        message = await receive()
        read += len(message.get("body", b""))
        if read > cap:
            raise errors.too_large(None, cap)
        return message

    return capped_receive
