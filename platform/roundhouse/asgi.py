"""ASGI entry point of the front (Daphne): HTTP through Django, WebSockets through
Channels. Importing it never imports torch, transformers, sentence_transformers or
llama_cpp (tests/platform/test_front_imports.py proves it).

The API (`/v1/`, `/healthz`, `/metrics`) is served by Django without its
middleware. Those middlewares (sessions, CSRF, auth, messages, clickjacking) mean
nothing to key-authenticated JSON, and each sync-style one costs a thread hop per
request on the way in and out: milliseconds before a stream's first token.
"""

import os
import sys

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application
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

API_PATHS = ("/v1/", "/healthz", "/metrics")


class BareASGIHandler(ASGIHandler):
    """Django's ASGI handler with no middleware: URL resolution, then the view.

    Nor does it give each request its own ThreadSensitiveContext: Django's
    handler does, so every request starts a new thread (and database connection)
    just to send `request_started`. The API's views keep database work off their
    path; what little there is runs in asgiref's one shared sync thread."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"the API serves HTTP only, not {scope['type']}")
        await self.handle(scope, receive, send)

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)


api_application = BareASGIHandler()


async def http_application(scope, receive, send):
    """The API paths to the bare handler, everything else (admin, pages) to
    Django with its full middleware."""
    path = scope.get("path", "")
    chosen = api_application if path.startswith(API_PATHS) else django_application
    await chosen(scope, receive, send)


application = ProtocolTypeRouter({"http": http_application})
