"""Bounds on what a caller may send: frame and text caps, sampling ranges, and
the checks of a text and of sampling fields. One schema for the engine (every
request), the admin (a model's defaults) and the REST schemas (which import
these)."""

import math
from typing import Any

from engines.wire.errors import bad_request

# Caps. A frame whose header announces more than MAX_FRAME_BYTES closes the
# connection unread: a client cannot make the engine allocate what it likes.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# A connection's first frame, its auth frame: a token (the supervisor's are 43
# characters) and its kind fit many times over.
MAX_AUTH_FRAME_BYTES = 4096
MAX_TOKEN_CHARS = 1024
# How long a new connection may take to send its auth frame (clients send it
# with their request, at once): a caller that sends nothing is dropped.
AUTH_TIMEOUT_S = 10.0
MAX_TEXTS_PER_REQUEST = 10_000
MAX_PROMPT_CHARS = 256 * 1024
MAX_MESSAGES = 1024

# Sampling bounds: one schema for the engine (every request, over the model's
# defaults), the admin (those defaults) and the REST schemas (which import these).
# A value past them used to reach llama.cpp or torch and raise in a decode thread.
MAX_SEED = 2**32 - 1  # llama.cpp's seed is a uint32
MIN_TEMPERATURE = 0.01  # 0 is greedy; logits / T overflow as T nears 0
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1000  # 0: off
MIN_REPEAT_PENALTY = 0.01  # logits are divided by it
MAX_REPEAT_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2]
MAX_TOKENS_CAP = 1 << 20
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20

# Control frames on loopback answer in well under a second; anything slower is an
# engine that is wedged or gone.
CONTROL_TIMEOUT_S = 2.0


# -- request validation -----------------------------------------------------------


def check_text(value: str, field: str) -> str:
    """A caller's text: no NUL character, and encodable as UTF-8 (JSON's `\\ud800`
    escape decodes to a lone surrogate, which is not)."""
    if "\x00" in value:
        raise bad_request(f"{field} must not contain a NUL character")
    if not encodable(value):
        raise bad_request(f"{field} is not valid Unicode (a lone surrogate)")
    return value


_FLOAT_BOUNDS = {
    "temperature": (0.0, MAX_TEMPERATURE),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repeat_penalty": (MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY),
    "presence_penalty": (-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY),
}
_INT_BOUNDS = {
    "top_k": (0, MAX_TOP_K),
    "max_tokens": (1, MAX_TOKENS_CAP),
    "seed": (0, MAX_SEED),
    "top_logprobs": (0, MAX_TOP_LOGPROBS),
}
TEMPERATURE_RANGE = f"0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
SAMPLING_FIELDS = (*_FLOAT_BOUNDS, *_INT_BOUNDS, "stop", "ignore_eos", "logprobs")


def check_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields among `fields`, each checked against the bounds above
    and normalised (numbers as float or int, `stop` as a tuple); `bad_request`
    naming the field otherwise. Other keys, and fields set to None, are skipped."""
    values: dict[str, Any] = {}
    for name, (low, high) in _FLOAT_BOUNDS.items():
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"{name} must be a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number")
        within = low <= value <= high
        if name == "temperature" and 0 < value < MIN_TEMPERATURE:
            within = False  # between greedy and the least warmth
        if not within:
            raise bad_request(_out_of_range(name, value, low, high))
        values[name] = float(value)
    for name, (low, high) in _INT_BOUNDS.items():
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be a whole number")
        if not low <= value <= high:
            raise bad_request(_out_of_range(name, value, low, high))
        values[name] = value
    values["stop"] = _check_stop(fields.get("stop"))
    for name in ("ignore_eos", "logprobs"):
        if fields.get(name) is not None:
            if not isinstance(fields[name], bool):
                raise bad_request(f"{name} must be true or false")
            values[name] = fields[name]
    return values


def _out_of_range(name: str, value: float, low: float, high: float) -> str:
    if name == "temperature":
        return f"temperature must be {TEMPERATURE_RANGE}"
    if value > high:
        return f"{name} must be at most {_number(high)}"
    if low == 1:
        return f"{name} must be positive"
    return f"{name} must be at least {_number(low)}"


def _number(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def _check_stop(stop: object) -> tuple[str, ...]:
    if stop is None or stop == [] or stop == ():
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(
        isinstance(item, str) and item for item in stop
    ):
        raise bad_request("stop must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings")
    for item in stop:
        if len(item) > MAX_STOP_CHARS:
            raise bad_request(f"a stop string is at most {MAX_STOP_CHARS} characters")
        check_text(item, "stop")
    return tuple(stop)


def encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
