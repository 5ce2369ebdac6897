"""Why the API refuses a request before it reaches an engine."""

from .errors import ApiCode


class KeyRejected(Exception):
    """The request's API key is missing, malformed, unknown or revoked (HTTP 401)."""

    def __init__(self, message: str, *, code: str = ApiCode.INVALID_API_KEY) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class KeyCheckUnavailable(Exception):
    """The key cannot be checked now: the database is unavailable and this
    process does not remember the key (HTTP 503)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class LimitExceeded(Exception):
    """The key is over its request rate or its concurrent requests, or the
    client (its address) over its failed keys (HTTP 429)."""

    def __init__(
        self,
        message: str,
        retry_after_s: int,
        *,
        code: str = ApiCode.RATE_LIMIT_EXCEEDED,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code
