"""ASGI entry point of the front (served by uvicorn, roundhouse/serve.py; also
runs under `daphne roundhouse.asgi:application`): HTTP through Django,
WebSockets through Channels (origin check, session auth, URL routes).
Importing it never imports torch, transformers, sentence_transformers or
llama_cpp (tests/platform/test_front_imports.py proves it).

The API (`/v1/`, `/healthz`, `/metrics`) is served by Django without its
middleware. Those middlewares (sessions, CSRF, auth, messages, clickjacking) mean
nothing to key-authenticated JSON, and each sync-style one costs a thread hop per
request on the way in and out: milliseconds before a stream's first token.

On the ASGI lifespan's shutdown (uvicorn sends it once the requests in flight
are done, after a SIGTERM) the front writes the usage rows still queued: uvicorn
then ends the process by raising the signal again, which skips atexit hooks.
"""

import asyncio
import contextlib
import os
import sys

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.conf import settings
from django.core.asgi import get_asgi_application
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")

# The event loop shares the GIL with background threads (usage writer, snapshot
# loads, sync_to_async calls). With Python's default 5 ms switch interval, a
# request arriving while one of them runs waits up to 5 ms for the GIL; 1 ms
# keeps that wait below the front's own cost per request.
sys.setswitchinterval(0.001)

# Django must be set up before anything imports models (the WebSocket routes will).
django_application = get_asgi_application()

# After set-up: the app imports its models.
from api import errors  # noqa: E402
from api.usage import usage_flush  # noqa: E402
from batches.views import UPLOAD_FORM_BYTES, upload_refusal  # noqa: E402
from chat.websocket_urls import websocket_urlpatterns  # noqa: E402

API_PATHS = ("/v1/", "/healthz", "/metrics")


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
        upload = scope.get("path") == "/v1/files" and scope.get("method") == "POST"
        if upload:
            # An upload (multipart): the file's cap, and room for the form.
            cap = settings.ROUNDHOUSE_MAX_FILE_BYTES + UPLOAD_FORM_BYTES
        try:
            declared = _content_length(scope)
            if declared is not None and declared > cap:
                raise errors.too_large(declared, cap)
            if upload and declared is not None:
                # Its key and the storage quotas, before the body is read.
                refusal = await upload_refusal(
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
            await self.send_response(refused.response(), send)
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


api_application = BareASGIHandler()


async def http_application(scope, receive, send):
    """The API paths to the bare handler, everything else (admin, pages) to
    Django with its full middleware."""
    path = scope.get("path", "")
    chosen = api_application if path.startswith(API_PATHS) else django_application
    await chosen(scope, receive, send)


async def lifespan_application(scope, receive, send):
    """ASGI lifespan: nothing to start; on shutdown, write the queued usage."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await asyncio.to_thread(usage_flush)
            await send({"type": "lifespan.shutdown.complete"})
            return


class OriginChecked:
    """Sockets from browsers come with an Origin header, which must name one
    of ALLOWED_HOSTS (Channels' AllowedHostsOriginValidator): a page of
    another site cannot use the visitor's session. A client that sends none
    is no browser (apps, scripts): it has no session to borrow and must send
    an API key, so it is let through."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.checked = AllowedHostsOriginValidator(inner)

    async def __call__(self, scope, receive, send):
        sent_origin = any(name == b"origin" for name, _ in scope.get("headers", ()))
        app = self.checked if sent_origin else self.inner
        return await app(scope, receive, send)


websocket_application = OriginChecked(
    AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
)

application = ProtocolTypeRouter(
    {
        "http": http_application,
        "websocket": websocket_application,
        "lifespan": lifespan_application,
    }
)
