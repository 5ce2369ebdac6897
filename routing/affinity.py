"""Cache-aware routing: which engine last served a conversation's prefix.

An engine keeps a finished request's KV in its slot, and a later request
sharing that prefix evaluates only the rest (engines/generation/prefix_sharing.py). With
replicas on several engines that saving is had only if the conversation's
next turn goes back to the same engine. Each front remembers, for every
prefix of the messages it routed (messages[:1], messages[:2], ... as chained
hashes), the engine it sent them to; a new request looks its own prefixes up,
longest first. A chat's next turn carries the previous turn's messages as a
prefix, so it finds the engine whose cache holds them (and the answer after
them). The router takes that engine unless it is much busier than another
replica (routing.select.AFFINITY_SLACK).
"""

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

# Prefixes remembered per front (about 100 bytes each).
MAX_PREFIXES = 200_000
# Only this many of a conversation's prefixes are remembered and looked up:
# the longest ones (a cache holds the latest turns), and the first (a shared
# system prompt).
MAX_PREFIXES_PER_REQUEST = 16


def prefix_keys(
    model: str, messages: Sequence[Any], *, scope: str = ""
) -> tuple[str, ...]:
    """The keys of `messages[:1]`, `messages[:2]`, ... for `model` (each a hash
    chained on the one before, the first on the model's name: another model's
    cache holds nothing of it), longest first, at most
    MAX_PREFIXES_PER_REQUEST of them: the longest ones and the first.

    `scope`: whose cache the keys are of (the front passes the caller's key or
    user, unless the model shares its prompt cache across them): the same
    messages in another scope have other keys, so no caller can find, by
    where it is routed, what another sent. "": one scope for every caller."""
    keys: list[str] = []
    seed = model if not scope else f"{model}\0{scope}"
    digest = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    for message in messages:
        text = json.dumps(message, sort_keys=True, separators=(",", ":"), default=str)
        digest = hashlib.blake2b(digest + text.encode(), digest_size=16).digest()
        keys.append(digest.hex())
    keys.reverse()
    if len(keys) > MAX_PREFIXES_PER_REQUEST:
        keys = keys[: MAX_PREFIXES_PER_REQUEST - 1] + keys[-1:]
    return tuple(keys)


class AffinityMap:
    """Prefix key -> the engine last sent that prefix (as the caller names it:
    the front stores the engine with its start, platform/api/affinity.py);
    least recently used forgotten first. Thread-safe."""

    def __init__(self, capacity: int = MAX_PREFIXES) -> None:
        self.capacity = capacity
        self._engines: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._engines)

    def lookup(self, keys: Iterable[str]) -> str:
        """The engine of the longest prefix remembered, or ""."""
        with self._lock:
            for key in keys:
                engine = self._engines.get(key)
                if engine is not None:
                    self._engines.move_to_end(key)
                    return engine
        return ""

    def remember(self, keys: Iterable[str], engine: str) -> None:
        """These prefixes were just sent to `engine`."""
        with self._lock:
            for key in keys:
                self._engines[key] = engine
                self._engines.move_to_end(key)
            while len(self._engines) > self.capacity:
                self._engines.popitem(last=False)
