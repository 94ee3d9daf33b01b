"""Django settings of the example marketplace.

Celery reads every ``CELERY_*`` name here (see ``proj/celery.py``); celery_redsem's settings are
``CELERY_REDSEM_*``. Point everything at another server with ``REDIS_URL=redis://host:6379/0``.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = ["market"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "proj.urls"
WSGI_APPLICATION = "proj.wsgi.application"
# The example keeps its books in Redis (see market/market_api.py); it needs no database.
DATABASES: dict[str, dict[str, str]] = {}
USE_TZ = True
TIME_ZONE = "UTC"

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

# -- Celery ------------------------------------------------------------------------------------
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = True
# With late acks, a task still running when the broker connection drops is delivered again;
# cancelling it keeps two copies of one task from running at once (see the failure modes page).
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# -- celery_redsem -----------------------------------------------------------------------------
CELERY_REDSEM_REDIS_URL = REDIS_URL
CELERY_REDSEM_KEY_PREFIX = "example"
# Short leases: a killed worker's permits come back within seconds; the heartbeat keeps a
# running task's permit (every lease / 3).
CELERY_REDSEM_LEASE = 6.0
# A task that finds its account busy retries quickly (backoff 0.2 s doubling to 2 s, jittered),
# keeping its place in the account's waiting line.
CELERY_REDSEM_RETRY_BACKOFF = 0.2
CELERY_REDSEM_RETRY_BACKOFF_MAX = 2.0
# A task whose lease was lost (worker frozen, admin force release) stops instead of going on.
CELERY_REDSEM_LOST_LEASE_POLICY = "raise"

# -- the marketplace (market/market_api.py) ----------------------------------------------------
# The marketplace serves at most this many concurrent calls per account.
MARKET_MAX_CONCURRENT_CALLS = 5
# Prefix of the keys in which the stand-in marketplace keeps its books.
MARKET_KEY_PREFIX = "market-api"
