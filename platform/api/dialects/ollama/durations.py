"""Ollama's `keep_alive` as seconds: a number of seconds, or a duration
string as Go's time.ParseDuration reads it ("5m", "1h30m", "300ms", "0");
either one below zero means no limit (-1 here), as Ollama reads it. A
number in a string ("-1", "300") is taken as seconds too, as Ollama's
OLLAMA_KEEP_ALIVE setting takes it (tools copy that spelling into requests).

What the seconds then mean for a model's residency (0: unloaded once idle)
is the engine's (engines/runtime/residency.py); a year or more is no limit
too, the most the engine protocol takes (engines.wire.requests.KeepAlive)."""

import math
import re

from pydantic_core import PydanticCustomError

from engines.wire.requests import MAX_KEEP_ALIVE_S

# Go's units, in seconds ("µs" in either of its spellings).
UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")
NO_LIMIT = -1.0


def _invalid(value: str) -> PydanticCustomError:
    return PydanticCustomError(
        "duration",
        "invalid duration {value}: a number of seconds, or a duration "
        'such as "5m", "1h30m" or "0"',
        {"value": repr(value)},
    )


def duration_seconds(text: str) -> float:
    """Go's time.ParseDuration, in seconds (an optional sign, then one or more
    number-and-unit parts; "0" alone needs no unit), or a plain number of
    seconds. PydanticCustomError for anything else."""
    if _NUMBER.fullmatch(text):
        return float(text)
    body, sign = text, 1.0
    if body and body[0] in "+-":
        sign = -1.0 if body[0] == "-" else 1.0
        body = body[1:]
    if body == "0":
        return 0.0
    if not body:
        raise _invalid(text)
    position, total = 0, 0.0
    while position < len(body):
        part = _PART.match(body, position)
        if part is None:
            raise _invalid(text)
        total += float(part.group(1)) * UNITS[part.group(2)]
        position = part.end()
    return sign * total


def keep_alive_seconds(value: str | float) -> float:
    """A `keep_alive` as the engine protocol takes it: seconds, NO_LIMIT for
    a negative one or one of a year or more."""
    seconds = duration_seconds(value) if isinstance(value, str) else float(value)
    if math.isnan(seconds):
        raise _invalid(str(value))
    if seconds < 0 or seconds >= MAX_KEEP_ALIVE_S:
        return NO_LIMIT
    return seconds
