"""The errors of a supervisor's long-lived loops (the heartbeat, the model
copies, the relay, the reconcile loop): a loop survives any error in one pass
and records it here. An error is logged once, when it appears or changes (not
on every pass), and once more when the loop works again; the ones that last
go to the node's row with each heartbeat (`loop_errors`), shown in the admin
(Fleet -> Nodes)."""

import contextlib
import logging
import threading
from datetime import UTC, datetime

log = logging.getLogger("roundhouse.supervisor")

MAX_ERROR_CHARS = 500


class LoopErrors:
    """Thread-safe: loops on several threads record into one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: dict[str, dict[str, str]] = {}

    def failed(self, loop: str, error: BaseException) -> None:
        """One pass of `loop` failed with `error` (logged with its traceback
        when it is news)."""
        message = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
        with self._lock:
            known = self._errors.get(loop)
            if known is not None and known["error"] == message:
                return
            since = datetime.now(UTC).isoformat(timespec="seconds")
            self._errors[loop] = {"error": message, "since": since}
        log.error(
            "the %s loop failed (it keeps running; logged again only when the "
            "error changes or clears): %s",
            loop,
            message,
            exc_info=error,
        )

    def cleared(self, loop: str) -> None:
        """A pass of `loop` went through."""
        with self._lock:
            known = self._errors.pop(loop, None)
        if known is not None:
            log.warning("the %s loop works again (was: %s)", loop, known["error"])

    @contextlib.contextmanager
    def guard(self, loop: str):
        """One pass of `loop`: any Exception is recorded, not raised."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - any error of one pass
            self.failed(loop, error)
        else:
            self.cleared(loop)

    def report(self) -> dict[str, dict[str, str]]:
        """For the node's row: each failing loop's error and since when."""
        with self._lock:
            return {loop: dict(error) for loop, error in sorted(self._errors.items())}
