"""Django settings for Roundhouse.

Every environment variable Roundhouse reads on the Django side is read here, once,
each with a comment and a default that runs embedded on one machine: SQLite, the
in-memory channel layer, a Celery broker that needs no server and the bundled models.
"""

import os
import secrets
import sys
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parents[2]

env = environ.Env()

# ROUNDHOUSE_RUN_DIR: where runtime state lives (secret key, SQLite database, engine
# token files, logs, locks). Created with mode 0700 when missing.
RUN_DIR = Path(env.str("ROUNDHOUSE_RUN_DIR", default=str(BASE_DIR / "var" / "run")))
RUN_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)

# ROUNDHOUSE_MODELS_DIR: where model files live. A model's relative path in the
# catalog is resolved against this directory; `make run` installs the bundled models
# here.
MODELS_DIR = Path(
    env.str("ROUNDHOUSE_MODELS_DIR", default=str(BASE_DIR / "var" / "models"))
)


def _secret_key_from_run_dir(run_dir: Path) -> str:
    """Read the generated secret key, creating it (mode 0600) on first use."""
    path = run_dir / "secret_key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text(encoding="utf-8").strip()
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        key = secrets.token_urlsafe(50)
        handle.write(key)
    return key


# SECRET_KEY: Django's signing key. When unset it is generated once into
# $ROUNDHOUSE_RUN_DIR/secret_key (mode 0600) and reused on every start.
SECRET_KEY = env.str("SECRET_KEY", default="") or _secret_key_from_run_dir(RUN_DIR)

# DEBUG: Django's debug mode; off unless set to a true value.
DEBUG = env.bool("DEBUG", default=False)

# ALLOWED_HOSTS: comma-separated host names the front answers to (the name or
# address clients put in the URL); any other is refused 400 (DisallowedHost).
# The front logs them at start (roundhouse/serve.py).
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])

# CSRF_TRUSTED_ORIGINS: comma-separated origins (scheme://name[:port]) whose
# form posts (the admin's login) are accepted when they differ from the
# request's own, as behind a reverse proxy that terminates HTTPS. Default: none.
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

# DATABASE_URL: the control-plane database. Default: SQLite in the run dir.
# PostgreSQL example: postgres://user@127.0.0.1:5432/roundhouse
DATABASES = {
    "default": env.db_url(
        "DATABASE_URL", default=f"sqlite:///{RUN_DIR / 'roundhouse.sqlite3'}"
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A database that stops answering (its host down, or this one cut off from
    # it) fails a connection attempt or a query within seconds instead of the
    # kernel's minutes: a node of a cluster must notice that it can no longer
    # confirm its place (cluster/, api.gateway), and one host's outage
    # handling (the last fleet read, the usage rows kept) starts sooner.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "connect_timeout": 5,
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 2,
            "tcp_user_timeout": 5000,  # ms unacknowledged before it gives up
        }
    )
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (front, supervisor, worker) share one SQLite file: wait
    # for a writer instead of failing at once with "database is locked".
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
    # A transaction takes the write lock when it begins (BEGIN IMMEDIATE), so it
    # waits for the timeout above. A deferred one that read first and writes
    # after another process committed cannot wait: SQLite refuses its write at
    # once ("database is locked"; its snapshot is out of date), which reached
    # callers as a 503 (an upload's quota check then insert, under a worker
    # recording answers).
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
    # Write-ahead logging: readers and the one writer do not block each other,
    # and a commit appends to the log without an fsync (synchronous=NORMAL; the
    # log is synced at checkpoints). The default rollback journal syncs the disk
    # several times per commit: the front's usage rows and the supervisor's
    # state writes then cost more CPU than the requests they record.
    DATABASES["default"]["OPTIONS"]["init_command"] = (
        "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
    )
    # Tests run supervisors in child processes: their database must be a file
    # those processes can open, not SQLite's default in-memory test database.
    DATABASES["default"]["TEST"] = {"NAME": str(RUN_DIR / "test.sqlite3")}

# REDIS_URL: when set, the channel layer and the Celery broker use this Redis
# (needed for more than one front process or host). Unset: in-memory channel
# layer and a filesystem Celery broker in the run dir.
REDIS_URL = env.str("REDIS_URL", default="")
# REDIS_CONNECT_TIMEOUT_S / REDIS_TIMEOUT_S: how long the API's limits
# (api.counters) wait for Redis to connect, and to answer a command, before
# they count in this process alone until Redis answers again. A request waits
# at most this long, once per outage.
REDIS_CONNECT_TIMEOUT_S = env.float("REDIS_CONNECT_TIMEOUT_S", default=0.5)
REDIS_TIMEOUT_S = env.float("REDIS_TIMEOUT_S", default=1.0)

INSTALLED_APPS = [
    # The admin's modules load with the URLs (roundhouse/urls.py runs
    # admin.autodiscover()), not at every process's start: a command such as
    # `manage.py pull` starts without them.
    "django.contrib.admin.apps.SimpleAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_celery_results",
    "django_celery_beat",
    "fleet",
    "cluster",
    "catalog",
    "api",
    "chat",
    "batches",
]

# daphne backs `manage.py runserver` (the front itself is uvicorn:
# roundhouse/serve.py); every other command starts without its Twisted imports.
if sys.argv[1:2] == ["runserver"]:
    INSTALLED_APPS.insert(0, "daphne")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "roundhouse.middleware.ContentSecurityPolicyMiddleware",
    "roundhouse.middleware.AsyncWhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "roundhouse.urls"

# Admin messages live only in a signed cookie until shown: the one that shows a
# new API key must never spill into the session table.
MESSAGE_STORAGE = "django.contrib.messages.storage.cookie.CookieStorage"

# ROUNDHOUSE_MAX_REQUEST_BYTES: the largest API request body the front reads
# (larger ones get HTTP 413 from their Content-Length, before being read).
ROUNDHOUSE_MAX_REQUEST_BYTES = env.int(
    "ROUNDHOUSE_MAX_REQUEST_BYTES", default=16 * 1024 * 1024
)
# ROUNDHOUSE_MAX_FILE_BYTES: the largest file POST /v1/files stores (a batch's
# input); checked from Content-Length before reading, and again while writing.
ROUNDHOUSE_MAX_FILE_BYTES = env.int(
    "ROUNDHOUSE_MAX_FILE_BYTES", default=200 * 1024 * 1024
)
# ROUNDHOUSE_FILES_DIR: where the Files API keeps files (batch inputs, outputs
# and errors). Default: the run dir's files/ folder.
ROUNDHOUSE_FILES_DIR = Path(
    env.str("ROUNDHOUSE_FILES_DIR", default=str(RUN_DIR / "files"))
)
ROUNDHOUSE_FILES_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
# ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES: what one owner's stored files may
# take (an owner as the Files API sees one: a user's keys together, or an
# ownerless key alone), uploads and their batches' output and error files
# together. 1 GiB holds five inputs at the largest upload and their answers.
ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES = env.int(
    "ROUNDHOUSE_FILES_QUOTA_PER_OWNER_BYTES", default=1024**3
)
# ROUNDHOUSE_FILES_QUOTA_TOTAL_BYTES: what all stored files may take, whoever
# owns them (10 GiB: ten owners at their quota).
ROUNDHOUSE_FILES_QUOTA_TOTAL_BYTES = env.int(
    "ROUNDHOUSE_FILES_QUOTA_TOTAL_BYTES", default=10 * 1024**3
)
# ROUNDHOUSE_FILES_MIN_FREE_BYTES: free space an upload must leave on the
# files' disk, whatever the quotas say (the database, its WAL and the logs may
# share that disk, and fail when it is full). 2 GiB: room for them to go on.
ROUNDHOUSE_FILES_MIN_FREE_BYTES = env.int(
    "ROUNDHOUSE_FILES_MIN_FREE_BYTES", default=2 * 1024**3
)
# ROUNDHOUSE_BATCH_RETRY_S: how long a worker tries a batch line again while
# the engines turn it away for now (overloaded, cooling, no engine up) before
# it goes to the error file.
ROUNDHOUSE_BATCH_RETRY_S = env.float("ROUNDHOUSE_BATCH_RETRY_S", default=600.0)
# ROUNDHOUSE_BATCH_CONCURRENCY: lines of a batch a worker keeps in flight at
# once (the engines serve live requests first whatever this is).
ROUNDHOUSE_BATCH_CONCURRENCY = env.int("ROUNDHOUSE_BATCH_CONCURRENCY", default=16)
# ROUNDHOUSE_OLLAMA_LOOPBACK_KEY: the API key (its prefix or its name) that a
# call to Ollama's API (/api/...) with no Authorization header acts as when it
# comes from this host's loopback address through no proxy, for tools that
# cannot send a key; its limits, models and usage apply. Empty: off.
ROUNDHOUSE_OLLAMA_LOOPBACK_KEY = env.str("ROUNDHOUSE_OLLAMA_LOOPBACK_KEY", default="")
# ROUNDHOUSE_RESPONSES_RETENTION_DAYS: how many days a stored Responses API
# answer (`store`, true by default) is kept, counted from when it was stored
# by the database's clock; older ones read as unknown at once and are deleted
# by beat's expire-stored-responses. 30, as OpenAI keeps them; 0: until its
# owner deletes it.
ROUNDHOUSE_RESPONSES_RETENTION_DAYS = env.int(
    "ROUNDHOUSE_RESPONSES_RETENTION_DAYS", default=30
)
if ROUNDHOUSE_RESPONSES_RETENTION_DAYS < 0:
    raise ImproperlyConfigured(
        "ROUNDHOUSE_RESPONSES_RETENTION_DAYS must be 0 (keep stored responses "
        "until deleted) or a number of days."
    )
# Django's own cap on request.body, kept in step.
DATA_UPLOAD_MAX_MEMORY_SIZE = ROUNDHOUSE_MAX_REQUEST_BYTES

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ASGI_APPLICATION = "roundhouse.asgi.application"
WSGI_APPLICATION = None

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Django's cache: Redis when REDIS_URL is set, shared by every front process.
# (The API's limits count in Redis through their own client, api.counters,
# which bounds every call and falls back to counting in this process.)
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            # Counters are small and many (one per key per minute): room for them.
            "OPTIONS": {"MAX_ENTRIES": 10000},
        }
    }

# Celery: Redis when REDIS_URL is set, else kombu's filesystem transport, which
# needs no server (queues are folders in the run dir).
CELERY_QUEUE_DIR = RUN_DIR / "celery"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict = {}
else:
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_QUEUE_DIR / "queue"),
        "data_folder_out": str(CELERY_QUEUE_DIR / "queue"),
        "processed_folder": str(CELERY_QUEUE_DIR / "processed"),
        # Broadcast exchanges (worker control); kombu's default is ./control.
        "control_folder": str(CELERY_QUEUE_DIR / "control"),
    }
    for _folder in ("queue", "processed", "control"):
        (CELERY_QUEUE_DIR / _folder).mkdir(mode=0o700, parents=True, exist_ok=True)
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Results (and failures, with their tracebacks) in the database, shown in the
# admin under "Celery results" (django-celery-results), with the task's name.
CELERY_RESULT_BACKEND = "django-db"
CELERY_RESULT_EXTENDED = True
CELERY_RESULT_EXPIRES = 7 * 24 * 3600
# Periodic tasks live in the database and are edited in the admin under
# "Periodic tasks" (django-celery-beat); the entries below are written there
# when beat starts, and an operator may change their interval or disable them.
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_BEAT_SCHEDULE = {
    # Batches whose worker is gone (killed on another host: its lease expired)
    # are queued again. A worker queues them itself when it starts.
    "resume-batches": {"task": "batches.resume", "schedule": 60.0},
    # Model pulls likewise (catalog.pull_jobs.pulls_resume).
    "resume-pulls": {"task": "catalog.resume_pulls", "schedule": 60.0},
    # Stored Responses answers past ROUNDHOUSE_RESPONSES_RETENTION_DAYS are
    # deleted (they already read as unknown; this frees their rows).
    "expire-stored-responses": {
        "task": "api.expire_stored_responses",
        "schedule": 3600.0,
    },
}
# A worker takes one message at a time: a long batch does not hold back
# messages another worker could take.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# Pages that need a login (the chat page) send visitors here; after logging in
# they land on the chat.
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/chat/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

STATIC_URL = "static/"
# Serve admin assets straight from the app folders: no collectstatic step.
WHITENOISE_USE_FINDERS = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "INFO"},
    # The Hub client's transport logs every request at INFO: a pull's own
    # progress says more, in one line.
    "loggers": {"httpx2": {"level": "WARNING"}},
}

# ROUNDHOUSE_ADMIN_USER / ROUNDHOUSE_ADMIN_PASSWORD: the demo staff user that
# `make run` creates once. Without a password one is generated and printed once.
ROUNDHOUSE_ADMIN_USER = env.str("ROUNDHOUSE_ADMIN_USER", default="admin")
ROUNDHOUSE_ADMIN_PASSWORD = env.str("ROUNDHOUSE_ADMIN_PASSWORD", default="")

# ROUNDHOUSE_HOST / ROUNDHOUSE_PORT: where the front listens (roundhouse/serve.py,
# whose --host and --port override them), default 127.0.0.1:8000.
ROUNDHOUSE_HOST = env.str("ROUNDHOUSE_HOST", default="127.0.0.1")
ROUNDHOUSE_PORT = env.int("ROUNDHOUSE_PORT", default=8000)

# -- cluster (cluster/, fleet/membership.py) ----------------------------------------
# A host joins with `manage.py supervise --node NAME`; its identity lives in the
# run dir (node.json, 0600). ROUNDHOUSE_JOIN_TOKEN: the one-time join token the
# admin shows with the node's join command, read once at the first start (an
# environment variable, never an argument: argv is visible to every user).
ROUNDHOUSE_JOIN_TOKEN = env.str("ROUNDHOUSE_JOIN_TOKEN", default="")
# ROUNDHOUSE_CLUSTER_TLS: the node's relay speaks TLS with a certificate it makes
# itself at first start (run dir, 0600 key); other nodes pin its SHA-256, which
# the node publishes in the database. Off: plain TCP, authenticated by the
# calling node's secret only (a trusted network).
ROUNDHOUSE_CLUSTER_TLS = env.bool("ROUNDHOUSE_CLUSTER_TLS", default=True)
# ROUNDHOUSE_CLUSTER_CA, _CERT, _KEY: a private CA instead (all three, on every
# host: the CA's certificate, this node's certificate it signed, naming the node
# as a DNS subject-alternative name or common name, and its key): links are
# mutual TLS checked against the CA and the node names (cluster/tls.py).
ROUNDHOUSE_CLUSTER_CA = env.str("ROUNDHOUSE_CLUSTER_CA", default="")
ROUNDHOUSE_CLUSTER_CERT = env.str("ROUNDHOUSE_CLUSTER_CERT", default="")
ROUNDHOUSE_CLUSTER_KEY = env.str("ROUNDHOUSE_CLUSTER_KEY", default="")
# ROUNDHOUSE_RELAY_BIND: the address the relay listens on. Default: the node's
# address as set in the admin (behind NAT, set the host's own address here).
ROUNDHOUSE_RELAY_BIND = env.str("ROUNDHOUSE_RELAY_BIND", default="")
# ROUNDHOUSE_DEVICE_MEMORY_FILE: GPU memory read from a JSON file instead of
# nvidia-smi / sysfs (tests); the node reports its cards from the same probes.
ROUNDHOUSE_DEVICE_MEMORY_FILE = env.str("ROUNDHOUSE_DEVICE_MEMORY_FILE", default="")
