"""ASGI entry point of the front (served by uvicorn, roundhouse/serve.py; also
runs under `daphne roundhouse.asgi:application`): HTTP through Django,
WebSockets through Channels (origin check, session auth, URL routes).
Importing it never imports torch, transformers, sentence_transformers or
llama_cpp (tests/platform/test_front_imports.py proves it).

The API (`/v1/`, `/api/`, `/healthz`, `/metrics`) is served by Django without its
middleware (roundhouse/bare_handler.py), given the Batch API's upload check.

On the ASGI lifespan's startup the front builds its long-lived parts (api.parts:
the gateway to the engines, the usage writer, the dashboard's feed), so that a
bad setting (a private CA file that cannot be read) fails the start, not the
first request; importing this module builds none of them. On its shutdown
(uvicorn sends it once the requests in flight are done, after a SIGTERM) the
front writes what it still has queued (the prompt prefixes it routed, for the
other fronts' routing; the usage rows): uvicorn then ends the process by
raising the signal again, which skips atexit hooks.
"""

import asyncio
import logging
import os
import sys
from collections.abc import Callable

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.conf import settings
from django.core.asgi import get_asgi_application
from django.http import HttpResponse

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")

# The event loop shares the GIL with background threads (usage writer, snapshot
# loads, sync_to_async calls). With Python's default 5 ms switch interval, a
# request arriving while one of them runs waits up to 5 ms for the GIL; 1 ms
# keeps that wait below the front's own cost per request.
sys.setswitchinterval(0.001)

# Django must be set up before anything imports models (the WebSocket routes will).
django_application = get_asgi_application()

# After set-up: the app imports its models.
from api.dialects.anthropic.translation import (  # noqa: E402
    error_response as anthropic_error_response,
)
from api.dialects.ollama.access import refusal as ollama_refusal  # noqa: E402
from api.errors import ApiError  # noqa: E402
from api.gateway import front_gateway  # noqa: E402
from api.usage import usage_flush, usage_writer  # noqa: E402
from batches.views import UPLOAD_FORM_BYTES, upload_refusal  # noqa: E402
from chat.dashboard import fleet_feed  # noqa: E402
from chat.websocket_urls import websocket_urlpatterns  # noqa: E402
from roundhouse.bare_handler import BareASGIHandler, UploadCheck  # noqa: E402

API_PATHS = (
    "/v1/",
    "/v2/",
    "/api/",
    "/tokenize",
    "/detokenize",
    "/healthz",
    "/metrics",
)
# Anthropic's Messages API answers its refusals in Anthropic's error shape,
# Ollama's API in Ollama's.
ANTHROPIC_PATHS = ("/v1/messages",)
OLLAMA_PATHS = ("/api/",)

log = logging.getLogger("roundhouse.serve")


def refusal_framing(path: str) -> Callable[[ApiError], HttpResponse]:
    """How a path's refusals before its view are framed: an API dialect's
    error shape, else OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_response
    if path.startswith(OLLAMA_PATHS):
        return ollama_refusal
    return ApiError.response


api_application = BareASGIHandler(
    upload=UploadCheck(
        path="/v1/files",
        # An upload (multipart): the file's cap, and room for the form.
        max_bytes=lambda: settings.ROUNDHOUSE_MAX_FILE_BYTES + UPLOAD_FORM_BYTES,
        refusal=upload_refusal,
    ),
    framing=refusal_framing,
)


async def http_application(scope, receive, send):
    """The API paths to the bare handler, everything else (admin, pages) to
    Django with its full middleware."""
    path = scope.get("path", "")
    chosen = api_application if path.startswith(API_PATHS) else django_application
    await chosen(scope, receive, send)


def front_start() -> None:
    """Build the front's long-lived parts (blocking: reads settings and files)."""
    front_gateway.start()
    usage_writer.start()
    fleet_feed.start()


async def lifespan_application(scope, receive, send):
    """ASGI lifespan: on startup, build the front's parts (a failure fails the
    start, with its reason); on shutdown, write the queued prefixes and usage."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await asyncio.to_thread(front_start)
            except Exception as error:
                log.exception("the front could not start")
                await send({"type": "lifespan.startup.failed", "message": str(error)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            gateway = front_gateway.built()
            if gateway is not None:
                await gateway.affinity.settled()
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
