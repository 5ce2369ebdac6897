"""Middleware adapted for an async front."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
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
