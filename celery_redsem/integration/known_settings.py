"""Every ``redsem_*`` setting once: its name in ``app.conf``, its default and what it does
(:data:`SETTINGS`; the docs are checked against it), and the warnings for keys that look like
one but are not read (:func:`unknown_setting_warnings`)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, NamedTuple

from celery_redsem.core.client import (
    DEFAULT_IDLE_TTL,
    DEFAULT_LEASE,
    DEFAULT_REPLICA_TIMEOUT,
)
from celery_redsem.core.keys import DEFAULT_PREFIX
from celery_redsem.core.validation import choice_rule

__all__ = [
    "DEFAULTS",
    "DEFAULT_REDIS_OPTIONS",
    "LOST_LEASE_POLICIES",
    "LOST_LEASE_POLICY",
    "SETTINGS",
    "Setting",
    "unknown_setting_warnings",
]

LOST_LEASE_POLICIES = ("log", "raise")
#: What a lost lease policy must be (the setting's and a decorator's ``lost_lease_policy``).
LOST_LEASE_POLICY = choice_rule(LOST_LEASE_POLICIES)

#: redis-py options used unless ``redsem_redis_options`` overrides them: bounded socket waits,
#: so a hung connection cannot stall the heartbeat for longer than a lease.
DEFAULT_REDIS_OPTIONS: Mapping[str, Any] = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}


class Setting(NamedTuple):
    """One ``redsem_*`` setting: its name in ``app.conf``, its default and what it does."""

    name: str
    default: Any
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "redsem_redis_url",
        None,
        "Redis URL for the semaphores; unset: the result backend, else the broker, if redis(s)://.",
    ),
    Setting(
        "redsem_redis_options",
        {},
        "Extra keyword arguments for the redis-py client (merged over 2 s socket timeouts).",
    ),
    Setting(
        "redsem_key_prefix", DEFAULT_PREFIX, "First part of every Redis key the plugin writes."
    ),
    Setting(
        "redsem_lease", DEFAULT_LEASE, "Default permit lease in seconds; refreshed every lease/3."
    ),
    Setting(
        "redsem_idle_ttl",
        DEFAULT_IDLE_TTL,
        "Seconds an idle semaphore's keys outlive their last lease.",
    ),
    Setting(
        "redsem_retry_backoff",
        0.25,
        "First retry countdown in seconds while no hold time is known, and after Redis errors.",
    ),
    Setting("redsem_retry_backoff_max", 10.0, "Cap on the contention-retry countdown in seconds."),
    Setting(
        "redsem_retry_jitter",
        True,
        "Randomise retry countdowns (full jitter on backoff, up to 30 % off line-based ones).",
    ),
    Setting(
        "redsem_retry_min_countdown",
        0.02,
        "Floor of a contention-retry countdown in seconds, also for the task first in line.",
    ),
    Setting(
        "redsem_head_wait",
        1.0,
        "Longest wait in the worker slot for a permit that is near, instead of a retry; 0: never.",
    ),
    Setting(
        "redsem_worker_admission",
        True,
        "Prefork workers hand a guarded task to a pool child only once it has its permit.",
    ),
    Setting(
        "redsem_waiter_margin",
        5.0,
        "Seconds a retried task keeps its place in line beyond the time it is expected back.",
    ),
    Setting(
        "redsem_max_wait",
        3600.0,
        "Total seconds a task may wait for a permit (or for Redis), then it fails; None: no cap.",
    ),
    Setting(
        "redsem_lost_lease_policy",
        "log",
        "On a lost lease: 'log' an error, or 'raise' PermitLost inside the running task.",
    ),
    Setting(
        "redsem_eager_timeout",
        30.0,
        "Seconds an eager (task_always_eager / apply) call blocks for a permit.",
    ),
    Setting(
        "redsem_dedupe_lease",
        3600.0,
        "Seconds a dedupe mark outlives its send (plus any countdown) while the run is queued.",
    ),
    Setting(
        "redsem_min_replicas",
        0,
        "Replicas that must acknowledge a grant (WAIT) before a task runs on it; 0: no WAIT.",
    ),
    Setting(
        "redsem_replica_timeout",
        DEFAULT_REPLICA_TIMEOUT,
        "Seconds a grant waits for its replica acknowledgements (with redsem_min_replicas).",
    ),
    Setting(
        "redsem_check_eviction_policy",
        True,
        "Warn at worker start if Redis' maxmemory-policy could evict semaphore keys.",
    ),
)

#: Each setting's default, by name.
DEFAULTS: Mapping[str, Any] = {s.name: s.default for s in SETTINGS}
_UNSET: Any = object()


def unknown_setting_warnings(conf: Mapping[str, Any]) -> list[str]:
    """A warning for each ``redsem_*`` key that is not read: a typo, or a setting spelled in
    a way ``app.conf`` does not map to it (``REDSEM_LEASE``; ``CELERY_REDSEM_LEASE`` loaded
    without ``namespace="CELERY"``)."""
    warnings = []
    for key in map(str, list(conf.keys())):
        name = key.lower().removeprefix("celery_")
        if name in DEFAULTS and key != name and conf.get(name, _UNSET) is _UNSET:
            warnings.append(
                f"celery_redsem: {key} is not read; write it as {name} (or CELERY_"
                f"{name.upper()} in Django settings loaded with namespace='CELERY')"
            )
        elif name.startswith("redsem_") and name not in DEFAULTS:
            close = difflib.get_close_matches(name, DEFAULTS, n=1)
            if close and key.isupper():  # as Django writes it
                close[0] = key[: len(key) - len(name)] + close[0].upper()
            warnings.append(
                f"celery_redsem: {key} is not a celery_redsem setting and is ignored"
                + (f"; did you mean {close[0]}?" if close else "")
            )
    return warnings
