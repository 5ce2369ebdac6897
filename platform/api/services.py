"""Writes of API keys, and authenticating a request's key."""

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Iterable
from datetime import timedelta

from django import db
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q
from django.utils import timezone

from catalog.models import ModelConfig

from .exceptions import KeyCheckUnavailable, KeyRejected, LimitExceeded
from .limits import FailureThrottle
from .models import ApiKey
from .selectors import api_key_get_by_hash, in_db_thread

__all__ = [
    "DATABASE_OUTAGE",
    "KeyCheckUnavailable",
    "KeyRejected",
    "LimitExceeded",
    "api_key_allows",
    "api_key_authenticate",
    "api_key_create",
    "api_key_hash",
    "api_key_issue",
    "api_key_revoke",
    "api_keys_revalidate",
    "stale_keys_waiting",
]

log = logging.getLogger("roundhouse.api")

KEY_PREFIX = "rh-"
# Characters of the key kept for display: "rh-" and 8 random ones.
DISPLAY_PREFIX_LENGTH = 11
# Longer than any key we issue: anything longer is refused without hashing it.
MAX_PRESENTED_LENGTH = 256
# last_used_at is written at most this often per key, not on every request.
LAST_USED_RESOLUTION = timedelta(minutes=1)
# Keys authenticated recently, by hash, so that requests need no database read on
# their path. An entry older than KEY_CACHE_S is still used (up to KEY_STALE_S)
# while `api_keys_revalidate` reads it again after the request. A key revoked in
# this process (the admin runs in the front) stops working at once; revoked from
# another process, at the first check after KEY_CACHE_S. While the database is
# down a remembered key keeps working, however old: it was live when last read,
# and no revocation can be recorded meanwhile.
KEY_CACHE_S = 5.0
KEY_STALE_S = 60.0
# After the database failed a revalidation, the next waits this long: requests
# that find stale keys meanwhile do not each send a query to a database that is
# down.
REVALIDATE_RETRY_S = 1.0
KEY_CACHE_SIZE = 10_000
_recent_keys: dict[str, tuple[ApiKey, float]] = {}
_stale_keys: set[str] = set()
# Keys refused recently (unknown or revoked), by hash, with the refusal and when:
# the same bad key sent again is refused from memory, with no query. A key
# issued in this process is forgotten here at once; issued by another, it works
# once REFUSED_KEY_CACHE_S have passed. Oldest first; the oldest goes when full.
REFUSED_KEY_CACHE_S = 5.0
REFUSED_KEY_CACHE_SIZE = 10_000
_refused_keys: dict[str, tuple[str, float]] = {}
# A client (its address) whose keys failed this often in a window is answered
# 429 until the window ends, before any lookup; keys in _recent_keys still work
# from it, as they cost nothing.
AUTH_FAILURES = FailureThrottle(limit=20, window_s=60.0, max_clients=10_000)


class DatabaseOutage:
    """Whether the database failed the last key lookup or write; logged once
    per outage (when it starts and when it ends), not once per request."""

    def __init__(self) -> None:
        self.down = False
        self.failed_at = -float("inf")  # time.monotonic()

    def failed(self, what: str, error: BaseException) -> None:
        self.failed_at = time.monotonic()
        if not self.down:
            self.down = True
            log.error(
                "the database is unavailable (%s: %s); API keys this process "
                "remembers keep working, others get 503 until it is back",
                what,
                error,
            )

    def worked(self) -> None:
        if self.down:
            self.down = False
            log.warning("the database is available again")

    def failed_within(self, seconds: float) -> bool:
        return time.monotonic() - self.failed_at < seconds


DATABASE_OUTAGE = DatabaseOutage()


def api_key_hash(plaintext: str) -> str:
    """The stored form of a key: its SHA-256, in hex."""
    # A fast unsalted hash is right here: keys carry 256 random bits, so there is
    # nothing to brute-force, and a deterministic hash lets us look the key up by
    # it. A slow password hash would only slow down every API request.
    return hashlib.sha256(plaintext.encode("utf-8", errors="replace")).hexdigest()


def api_key_issue(*, key: ApiKey) -> str:
    """Give an unsaved key a fresh secret, save it, and return the secret.

    The secret is returned to be shown once; only its hash and prefix are stored.
    """
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    key.prefix = plaintext[:DISPLAY_PREFIX_LENGTH]
    key.key_hash = api_key_hash(plaintext)
    key.full_clean()
    key.save()
    _refused_keys.pop(key.key_hash, None)
    return plaintext


def api_key_create(
    *,
    name: str,
    owner: AbstractBaseUser | None = None,
    allowed_models: Iterable[ModelConfig] = (),
    rpm_limit: int = 0,
    max_concurrent: int = 0,
) -> tuple[ApiKey, str]:
    """Create a key; return it and its plaintext, which is never available again."""
    key = ApiKey(
        name=name, owner=owner, rpm_limit=rpm_limit, max_concurrent=max_concurrent
    )
    plaintext = api_key_issue(key=key)
    models = list(allowed_models)
    key.allowed_models.set(models)
    key.allowed_model_names = frozenset(model.name for model in models)
    return key, plaintext


def api_key_revoke(*, key: ApiKey) -> None:
    """Revoke a key: every later request with it is refused."""
    if key.revoked_at is not None:
        return
    key.revoked_at = timezone.now()
    key.full_clean()
    key.save(update_fields=["revoked_at"])
    _recent_keys.pop(key.key_hash, None)


def _recent_key(digest: str) -> ApiKey | None:
    """A key this process authenticated recently, if any (marked for
    revalidation once older than KEY_CACHE_S). While the database is down
    (the last lookup, write or revalidation failed) a remembered key is used
    however old, with no query on the request's path: each would wait out
    the database's connect timeout, one after another."""
    found = _recent_keys.get(digest)
    if found is None:
        return None
    age = time.monotonic() - found[1]
    if age > KEY_STALE_S and not DATABASE_OUTAGE.down:
        return None
    if age > KEY_CACHE_S:
        _stale_keys.add(digest)
    return found[0]


def stale_keys_waiting() -> bool:
    """Whether remembered keys wait for `api_keys_revalidate` (not within
    REVALIDATE_RETRY_S of a revalidation the database failed)."""
    return bool(_stale_keys) and not DATABASE_OUTAGE.failed_within(REVALIDATE_RETRY_S)


async def api_keys_revalidate() -> None:
    """Read again the remembered keys that were used while stale: revoked or
    deleted ones are forgotten, the others remembered afresh. A database that
    fails leaves them as they are, to be read again at the next try."""
    while _stale_keys:
        digest = _stale_keys.pop()
        try:
            key = await api_key_get_by_hash(key_hash=digest)
        except db.Error as error:
            _stale_keys.add(digest)
            DATABASE_OUTAGE.failed("reading API keys again", error)
            return
        DATABASE_OUTAGE.worked()
        if key is None or key.revoked_at is not None:
            _recent_keys.pop(digest, None)
        else:
            _remember_key(key)


def _remember_key(key: ApiKey) -> None:
    if len(_recent_keys) >= KEY_CACHE_SIZE:
        _recent_keys.clear()  # rare: more live keys than that in a few seconds
    _recent_keys[key.key_hash] = (key, time.monotonic())


def _refusal(digest: str) -> str | None:
    """Why the key with this hash was refused moments ago, if it was."""
    found = _refused_keys.get(digest)
    if found is None:
        return None
    if time.monotonic() - found[1] > REFUSED_KEY_CACHE_S:
        del _refused_keys[digest]
        return None
    return found[0]


def _remember_refusal(digest: str, message: str) -> None:
    _refused_keys.pop(digest, None)
    while len(_refused_keys) >= REFUSED_KEY_CACHE_SIZE:
        del _refused_keys[next(iter(_refused_keys))]
    _refused_keys[digest] = (message, time.monotonic())


def _masked(presented: str) -> str:
    """Enough of a presented key to recognise it, never all of it."""
    head = min(7, len(presented) // 4)
    tail = min(4, len(presented) // 4)
    return f"{presented[:head]}...{presented[-tail:] if tail else ''}"


async def api_key_authenticate(
    *, authorization: str | None, client: str | None = None
) -> ApiKey:
    """The live key of an `Authorization: Bearer <key>` header, or KeyRejected.

    The key comes back with `allowed_model_names` (a frozenset) set, so that
    `api_key_allows` needs no query. `last_used_at` is written at most once a
    minute per key, if the database allows (a failed write fails no request).
    A key refused moments ago is refused again from memory; `client` (the
    caller's address), when given, is throttled on its failed keys:
    LimitExceeded, before any lookup, once it is over AUTH_FAILURES. While the
    database is down, a key this process remembers is used; any other is
    KeyCheckUnavailable.
    """
    if not authorization or not authorization.strip():
        raise KeyRejected(
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer "
            "YOUR_KEY)."
        )
    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise KeyRejected(
            "Malformed Authorization header. Expected 'Authorization: Bearer YOUR_KEY'."
        )
    presented = parts[1]
    if len(presented) > MAX_PRESENTED_LENGTH:
        raise KeyRejected(f"Incorrect API key provided: {_masked(presented)}.")
    digest = api_key_hash(presented)
    key = _recent_key(digest)
    if key is None:
        key = await _key_looked_up(digest=digest, presented=presented, client=client)
    await _last_used_touch(key=key)
    return key


async def _key_looked_up(*, digest: str, presented: str, client: str | None) -> ApiKey:
    """The live key with this hash from the database, unless the client is
    over its failed keys (LimitExceeded) or the key was refused moments ago.
    Concurrent lookups of one key share one database read (`_key_reads`); a
    lookup counts against the client's failed keys only when it failed."""
    if client is not None:
        AUTH_FAILURES.check(client)
    refusal = _refusal(digest)
    if refusal is None:
        read, mine = await _key_read_shared(
            digest=digest, client=client, refusal=_unknown_key(presented)
        )
        try:
            key = await asyncio.shield(read)
        except db.Error as error:
            DATABASE_OUTAGE.failed("looking up an API key", error)
            remembered = _recent_keys.get(digest)
            if remembered is not None:  # older than KEY_STALE_S
                return remembered[0]
            raise KeyCheckUnavailable(
                "The API key could not be checked: the database is unavailable. "
                "Try again shortly."
            ) from None
        DATABASE_OUTAGE.worked()
        if key is not None:
            return key
        refusal = _refusal(digest) or _unknown_key(presented)  # remembered
        if mine:  # its read counted the failure already
            raise KeyRejected(refusal)
    if client is not None:
        AUTH_FAILURES.failed(client)
    raise KeyRejected(refusal)


# The database reads of keys in flight, by hash: a burst of requests with one
# key whose cache entry expired makes one read, not one each.
_key_reads: dict[str, asyncio.Task] = {}


async def _key_read_shared(
    *, digest: str, client: str | None, refusal: str
) -> tuple[asyncio.Task, bool]:
    """The read in flight of this key (and False), or a new one (and True)
    that holds one of the client's lookup slots until it ends."""
    loop = asyncio.get_running_loop()
    running = _key_reads.get(digest)
    if running is not None and running.get_loop() is loop:
        return running, False
    if client is not None:
        await AUTH_FAILURES.lookup_slot(client)  # may wait, or LimitExceeded
        running = _key_reads.get(digest)  # one may have started meanwhile
        if running is not None and running.get_loop() is loop:
            AUTH_FAILURES.lookup_done(client)
            return running, False
    read = loop.create_task(_key_read(digest=digest, client=client, refusal=refusal))
    _key_reads[digest] = read
    read.add_done_callback(lambda done: _key_read_forget(digest, done))
    return read, True


def _key_read_forget(digest: str, read: asyncio.Task) -> None:
    if _key_reads.get(digest) is read:
        del _key_reads[digest]
    if not read.cancelled():
        read.exception()  # retrieved: every waiter may have left


async def _key_read(*, digest: str, client: str | None, refusal: str) -> ApiKey | None:
    """The live key with this hash (remembered), or None (its refusal, or
    `refusal` for a key that does not exist, remembered and, for `client`,
    counted as a failure before its waiters look again); db.Error when the
    database failed."""
    try:
        key = await api_key_get_by_hash(key_hash=digest)
        # The lookup by hash already matched; comparing again in constant
        # time keeps the decision itself free of timing differences, whatever
        # the database does.
        if key is not None and hmac.compare_digest(key.key_hash, digest):
            if key.revoked_at is None:
                _remember_key(key)
                return key
            refusal = f"The API key {key.prefix}... has been revoked."
        _remember_refusal(digest, refusal)
        if client is not None:
            AUTH_FAILURES.failed(client)
        return None
    finally:
        if client is not None:
            AUTH_FAILURES.lookup_done(client)


def _unknown_key(presented: str) -> str:
    return (
        f"Incorrect API key provided: {_masked(presented)}. Ask the "
        "administrator of this server for a key."
    )


async def _last_used_touch(*, key: ApiKey) -> None:
    """Record that the key was used, unless that was recorded in the last
    minute. Best-effort: a write the database fails is tried again a minute
    later, and fails no request."""
    now = timezone.now()
    stale = now - LAST_USED_RESOLUTION
    if key.last_used_at is not None and key.last_used_at > stale:
        return
    # Set first: requests with this key meanwhile neither write it too nor,
    # while the database is down, each try again.
    key.last_used_at = now
    try:
        await _last_used_write(pk=key.pk, now=now, stale=stale)
    except db.Error as error:
        DATABASE_OUTAGE.failed("recording when an API key was last used", error)
    else:
        DATABASE_OUTAGE.worked()


@in_db_thread
def _last_used_write(*, pk: int, now, stale) -> None:
    # The condition is repeated in the UPDATE so that front processes seeing the
    # same stale value write once between them, not once each.
    ApiKey.objects.filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lte=stale), pk=pk
    ).update(last_used_at=now)


def api_key_allows(*, key: ApiKey, model: str) -> bool:
    """Whether the key may use this model (no models chosen: every model).

    Makes no query on a key from `api_key_authenticate` or `api_key_create`,
    which set its `allowed_model_names`.
    """
    names: frozenset[str] | None = getattr(key, "allowed_model_names", None)
    if names is None:
        # A key loaded some other way: read its models (a query unless they were
        # prefetched), and keep them on the key.
        names = key.allowed_model_names = frozenset(
            allowed.name for allowed in key.allowed_models.all()
        )
    return not names or model in names
