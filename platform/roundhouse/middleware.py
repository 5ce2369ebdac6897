"""Middleware adapted for an async front, and the pages' Content Security
Policy."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import DisallowedHost
from whitenoise.middleware import WhiteNoiseMiddleware


class AsyncWhiteNoiseMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise, async-capable. WhiteNoise's own middleware is sync-only, and
    one sync-only middleware makes Django run every request's whole chain in a
    worker thread: streamed API answers would lose their cancellation on
    disconnect and pay a thread hop. Static files are still served by WhiteNoise,
    in a thread; everything else passes straight through."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response, *args, **kwargs) -> None:
        super().__init__(get_response, *args, **kwargs)
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request):
        if self.autorefresh:
            static_file = await sync_to_async(self.find_file)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve)(static_file, request)
        return await self.get_response(request)


# What the front's pages may load and run: their own scripts, styles and
# images (and images inlined as data:), their own WebSocket, nothing else. A
# chat answer may be steered by whatever a model read; if an answer ever
# slipped past the page's sanitizer, it still could not load anything from
# elsewhere (an image URL carrying the conversation away) nor run a script.
# The pages have no inline script (the JSON they hand their scripts is a
# `json_script` data block, which is not run), nor does Django's admin.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "font-src 'self'",
    "connect-src 'self'{websockets}",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
)


class ContentSecurityPolicyMiddleware:
    """Send CONTENT_SECURITY_POLICY on every response that has none (a view
    may set its own), sync or async."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return _with_policy(request, self.get_response(request))

    async def __acall__(self, request):
        return _with_policy(request, await self.get_response(request))


def _with_policy(request, response):
    if "Content-Security-Policy" not in response:
        response["Content-Security-Policy"] = content_security_policy(request)
    return response


def content_security_policy(request) -> str:
    """The policy for this request: its WebSocket URLs are its own host's
    (`'self'` covers them in browsers that follow CSP 3; named for the rest)."""
    try:
        host = request.get_host()
    except DisallowedHost:  # answered 400 already: no page to protect
        websockets = ""
    else:
        websockets = f" ws://{host} wss://{host}"
    return "; ".join(CONTENT_SECURITY_POLICY).format(websockets=websockets)
