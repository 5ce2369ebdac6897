"""The front's long-lived parts (the gateway to the engines, the usage writer,
the dashboard's fleet feed), none built at import.

Each is a `Part`: built when its process starts (the ASGI lifespan's startup
builds the front's, roundhouse/asgi.py; a Celery worker's start builds the
gateway and the usage writer, roundhouse/celery.py), so that a bad setting,
such as a private CA file that cannot be read, stops the process there; or, in
a process that started none (a management command, a test), at first use. A
test installs its own with `installed`, instead of patching a module global.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Part(Generic[T]):
    """One long-lived object of a process: `part()` is it (built by `build`
    on first use), `start()` builds it now."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._value: T | None = None
        self._lock = threading.Lock()

    def __call__(self) -> T:
        value = self._value
        if value is None:
            return self.start()
        return value

    def start(self) -> T:
        """Build it now, if it is not built yet (once, whatever threads ask)."""
        with self._lock:
            if self._value is None:
                self._value = self._build()
            return self._value

    def built(self) -> T | None:
        """It if it is built; never builds it (for a shutdown: nothing to
        close in a process that never used it)."""
        return self._value

    @contextlib.contextmanager
    def installed(self, value: T) -> Iterator[T]:
        """Use `value` for the duration (a test's own), then the one before."""
        with self._lock:
            before, self._value = self._value, value
        try:
            yield value
        finally:
            with self._lock:
                self._value = before
