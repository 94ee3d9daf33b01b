"""Settings: the one place that reads ``app.conf``.

Every setting is named ``redsem_*`` in ``app.conf``; with Django's
``app.config_from_object("django.conf:settings", namespace="CELERY")`` write them as
``CELERY_REDSEM_*``. Celery maps both spellings onto the same key, so
``app.conf.get("redsem_lease")`` reads either. :data:`SETTINGS` lists every setting once, with
its default and meaning (the docs are checked against it).

:func:`get_config` reads and validates the settings once per app; :func:`get_client` gives each
app its own Redis client, rebuilt in a forked child instead of reusing the parent's connections.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from celery.local import Proxy

from celery_redsem.core.client import RedisClient
from celery_redsem.core.clients import client_from_url
from celery_redsem.core.errors import ConfigurationError
from celery_redsem.core.redaction import redact_url, safe_repr, scrub
from celery_redsem.core.validation import Rule, count_rule, seconds_rule, validate_prefix
from celery_redsem.integration.known_settings import (
    DEFAULT_REDIS_OPTIONS,
    DEFAULTS,
    LOST_LEASE_POLICIES,
    LOST_LEASE_POLICY,
    SETTINGS,
    Setting,
    unknown_setting_warnings,
)

__all__ = [
    "DEFAULT_REDIS_OPTIONS",
    "LOST_LEASE_POLICIES",
    "LOST_LEASE_POLICY",
    "SETTINGS",
    "SPARE_CONNECTIONS",
    "RedsemConfig",
    "Setting",
    "defer_setting_warnings",
    "deferred_setting_warnings",
    "expect_concurrency",
    "get_client",
    "get_config",
    "reset",
    "unknown_setting_warnings",
]

logger = logging.getLogger(__name__)

_NULLABLE = frozenset({"redsem_redis_url", "redsem_max_wait"})
_REDIS_SCHEMES = ("redis", "rediss")
_COUNT = count_rule(minimum=0)
_UNSET: Any = object()


@dataclass(frozen=True)
class RedsemConfig:
    """The validated ``redsem_*`` settings of one app, built by :meth:`from_conf`.

    Its fields have no defaults of their own: an unset setting takes its default from
    :data:`SETTINGS`, the one place that states them.
    """

    redis_url: str | None = field(repr=False)
    redis_url_source: str
    redis_options: Mapping[str, Any] = field(repr=False)
    key_prefix: str
    lease: float
    idle_ttl: float
    retry_backoff: float
    retry_backoff_max: float
    retry_jitter: bool
    retry_min_countdown: float
    head_wait: float
    worker_admission: bool
    waiter_margin: float
    max_wait: float | None
    lost_lease_policy: str
    eager_timeout: float
    dedupe_lease: float
    min_replicas: int
    replica_timeout: float
    check_eviction_policy: bool

    @property
    def present_waiter_lease(self) -> float:
        """The waiter lease of a task asking now: it keeps its place for the shortest
        countdown plus the margin, enough to be re-published or parked before it asks again
        with its own."""
        return self.waiter_margin + self.retry_min_countdown

    def require_redis_url(self) -> str:
        """The Redis URL, or a :class:`ConfigurationError` saying how to set one."""
        if self.redis_url is None:
            raise ConfigurationError(
                "no Redis server for the semaphores: set redsem_redis_url "
                "(Django: CELERY_REDSEM_REDIS_URL), or use a redis:// result backend or broker"
            )
        return self.redis_url

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any], namespace: str | None = None) -> RedsemConfig:
        """Read and validate the settings from an app's ``conf`` (or any mapping)."""
        read = _Reader(conf, namespace)
        url, source = _redis_url(conf, read)
        return cls(
            redis_url=url,
            redis_url_source=source,
            redis_options={**DEFAULT_REDIS_OPTIONS, **read.redis_options("redsem_redis_options")},
            key_prefix=read.prefix("redsem_key_prefix"),
            lease=read.seconds("redsem_lease"),
            idle_ttl=read.seconds("redsem_idle_ttl"),
            retry_backoff=read.seconds("redsem_retry_backoff", zero_ok=True),
            retry_backoff_max=read.seconds("redsem_retry_backoff_max", zero_ok=True),
            retry_jitter=read.boolean("redsem_retry_jitter"),
            retry_min_countdown=read.seconds("redsem_retry_min_countdown", zero_ok=True),
            head_wait=read.seconds("redsem_head_wait", zero_ok=True),
            worker_admission=read.boolean("redsem_worker_admission"),
            waiter_margin=read.seconds("redsem_waiter_margin"),
            max_wait=read.seconds("redsem_max_wait", none_ok=True),
            lost_lease_policy=read.checked("redsem_lost_lease_policy", LOST_LEASE_POLICY),
            eager_timeout=read.seconds("redsem_eager_timeout", zero_ok=True),
            dedupe_lease=read.seconds("redsem_dedupe_lease"),
            min_replicas=read.count("redsem_min_replicas"),
            replica_timeout=read.seconds("redsem_replica_timeout"),
            check_eviction_policy=read.boolean("redsem_check_eviction_policy"),
        )


#: redis-py options that redis-py does not check until it connects: what each must be.
_TIMING_OPTIONS: Mapping[str, Rule] = {
    "socket_timeout": seconds_rule(none_ok=True),
    "socket_connect_timeout": seconds_rule(none_ok=True),
    "health_check_interval": seconds_rule(zero_ok=True),
    "max_connections": count_rule(none_ok=True),
}


class _Reader:
    """Typed access to ``redsem_*`` settings; errors name the setting."""

    def __init__(self, conf: Mapping[str, Any], namespace: str | None = None) -> None:
        self.conf = conf
        self.namespace = namespace  # of settings loaded with config_from_object(namespace=)

    def get(self, name: str) -> Any:
        """The value set for ``name``; the default if unset (or None where None means nothing)."""
        value = self.conf.get(name, _UNSET)
        if value is _UNSET or (value is None and name not in _NULLABLE):
            return DEFAULTS[name]
        return value

    def _spelled(self, name: str) -> str:
        """``name`` as the app's settings spell it (Django: ``CELERY_REDSEM_...``)."""
        if self.namespace:
            return f"{self.namespace}_{name.upper()} ({name})"
        return name

    def _fail(self, name: str, expected: str, value: object) -> ConfigurationError:
        return ConfigurationError(
            f"setting {self._spelled(name)} must be {expected}, got {safe_repr(value)}"
        )

    def checked(self, name: str, rule: Rule) -> Any:
        """The value of ``name`` as ``rule`` accepts and converts it."""
        value = self.get(name)
        if not rule.accepts(value):
            raise self._fail(name, rule.expected, value)
        return rule.convert(value)

    def seconds(self, name: str, *, zero_ok: bool = False, none_ok: bool = False) -> Any:
        return self.checked(name, seconds_rule(zero_ok=zero_ok, none_ok=none_ok))

    def count(self, name: str) -> int:
        count: int = self.checked(name, _COUNT)
        return count

    def boolean(self, name: str) -> bool:
        value = self.get(name)
        if not isinstance(value, bool):
            raise self._fail(name, "True or False", value)
        return value

    def mapping(self, name: str) -> dict[str, Any]:
        value = self.get(name)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise self._fail(name, "a dict of redis-py keyword arguments", value)
        return dict(value)

    def redis_options(self, name: str) -> dict[str, Any]:
        """redis-py keyword arguments; the timing ones are checked here, since redis-py
        takes any value and fails only when it connects (a str read from the environment)."""
        options = self.mapping(name)
        for option, rule in _TIMING_OPTIONS.items():
            if option in options and not rule.accepts(options[option]):
                raise self._fail(name, f"a dict whose {option!r} is {rule.expected}", options)
        return options

    def prefix(self, name: str) -> str:
        value = self.get(name)
        try:
            return validate_prefix(value)
        except ConfigurationError:
            raise self._fail(name, "a non-empty str without '{', '}' or '*'", value) from None


def _redis_url(conf: Mapping[str, Any], read: _Reader) -> tuple[str | None, str]:
    """The configured URL, else a redis:// result backend, else a redis:// broker."""
    url = read.get("redsem_redis_url")
    if url is not None:
        if not isinstance(url, str) or not url:
            raise read._fail("redsem_redis_url", "a redis:// URL", url)
        return url, "redsem_redis_url"
    for source in ("result_backend", "broker_url"):
        candidate = _first_url(getattr(conf, source, None) or conf.get(source))
        if candidate and candidate.split("://", 1)[0].lower() in _REDIS_SCHEMES:
            return candidate, source
    return None, "redsem_redis_url"


def _first_url(value: object) -> str | None:
    """The first URL of a setting that may hold a list or a ``;``-separated failover list."""
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    if not isinstance(value, str):
        return None
    return value.split(";", 1)[0].strip() or None


# -- per-app caches -----------------------------------------------------------------------------

_lock = threading.Lock()
_configs: weakref.WeakKeyDictionary[Celery, RedsemConfig] = weakref.WeakKeyDictionary()
_deferred_warnings: weakref.WeakSet[Celery] = weakref.WeakSet()
_clients: weakref.WeakKeyDictionary[Celery, tuple[int, RedisClient]] = weakref.WeakKeyDictionary()


def _real_app(app: Celery) -> Celery:
    """``app`` itself, or the app behind a Celery proxy (``celery.current_app``, ``task.app``).

    A proxy cannot be weakly referenced, and two proxies of one app must share its cache entry.
    """
    if isinstance(app, Proxy):
        real: Celery = app._get_current_object()
        return real
    return app


def get_config(app: Celery) -> RedsemConfig:
    """The app's :class:`RedsemConfig`, read from ``app.conf`` at first use and then cached.

    ``app`` may be a proxy such as ``celery.current_app``.
    """
    app = _real_app(app)
    with _lock:
        config = _configs.get(app)
        if config is None:
            config = RedsemConfig.from_conf(app.conf, getattr(app, "namespace", None))
            _configs[app] = config
            if app not in _deferred_warnings:
                for warning in unknown_setting_warnings(app.conf):
                    logger.warning("%s", warning)
        return config


def defer_setting_warnings(app: Celery) -> None:
    """Keep the unknown-setting warnings of ``app`` for :func:`deferred_setting_warnings`:
    a worker reads its settings before its logging is set up, and logs them once it is."""
    app = _real_app(app)
    with _lock:
        if app not in _configs:  # else they are logged already
            _deferred_warnings.add(app)


def deferred_setting_warnings(app: Celery) -> list[str]:
    """The unknown-setting warnings kept by :func:`defer_setting_warnings` (once)."""
    app = _real_app(app)
    with _lock:
        if app not in _deferred_warnings:
            return []
        _deferred_warnings.discard(app)
    return unknown_setting_warnings(app.conf)


def refresh_stall_warning(config: RedsemConfig, lease: float, whose: str) -> str | None:
    """A warning if one hung Redis call could outlast a heartbeat interval (``lease`` / 3);
    ``whose``: where the lease is set (``redsem_lease``, a task's ``lease=``)."""
    timeout = config.redis_options.get("socket_timeout")
    if not isinstance(timeout, int | float) or timeout <= lease / 3:
        return None
    return (
        f"celery_redsem: the Redis client's socket_timeout ({timeout}s: redsem_redis_options, "
        f"or its default) is longer than a heartbeat interval ({whose}={lease}s / 3): one hung "
        "refresh can hold up the others for longer than that; set a socket_timeout of at "
        "most lease/3 in redsem_redis_options"
    )


def get_client(app: Celery) -> RedisClient:
    """The app's Redis client in this process (a forked child builds its own).

    ``app`` may be a proxy such as ``celery.current_app``.
    """
    app = _real_app(app)
    pid = os.getpid()
    with _lock:
        cached = _clients.get(app)
        if cached is not None and cached[0] == pid:
            return cached[1]
    config = get_config(app)
    url = config.require_redis_url()
    try:
        client = client_from_url(url, **config.redis_options)
    except (TypeError, ValueError) as exc:  # ConfigurationError included: say where it came from
        where = f"{redact_url(url)!r} (from {config.redis_url_source})"
        own_options = sorted(
            name
            for name, value in config.redis_options.items()
            if DEFAULT_REDIS_OPTIONS.get(name, _UNSET) != value
        )
        with_options = f" with redsem_redis_options {own_options}" if own_options else ""
        raise ConfigurationError(
            f"cannot build a Redis client for {where}{with_options}: "
            f"{scrub(str(exc), url, config.redis_options)}"
        ) from exc
    _fit_pool(client, config, _concurrency.get(app, 0))
    with _lock:
        cached = _clients.get(app)
        if cached is not None and cached[0] == pid:
            return cached[1]
        _clients[app] = (pid, client)
        return client


#: The most tasks a worker of the app runs at once in one process, where it runs them in
#: threads or greenlets (see expect_concurrency).
_concurrency: weakref.WeakKeyDictionary[Celery, int] = weakref.WeakKeyDictionary()
#: Connections the plugin may need in a worker process beyond one per running task: admission's
#: asks, its dispatcher, the heartbeat, a standby's wait.
SPARE_CONNECTIONS = 10


def expect_concurrency(app: Celery, tasks: int) -> None:
    """A worker of ``app`` runs up to ``tasks`` at once in this process (threads, gevent,
    eventlet): the app's client gets a connection pool that many can share (see
    :func:`_fit_pool`). Call it before the client is first built."""
    app = _real_app(app)
    with _lock:
        _concurrency[app] = tasks
        cached = _clients.pop(app, None)
    if cached is not None and cached[0] == os.getpid():
        cached[1].close()


def _fit_pool(client: RedisClient, config: RedsemConfig, tasks: int) -> None:
    """Widen the connection pool of ``client`` to ``tasks`` plus :data:`SPARE_CONNECTIONS`
    unless ``redsem_redis_options`` sets ``max_connections`` (redis-py 8 pools hold 100 by
    default: at ``-c 200`` releases failed with "Too many connections", each leaving a permit
    idle for its lease). Pools that size themselves otherwise (blocking, cluster) are kept."""
    pool = getattr(client, "connection_pool", None)
    limit = getattr(pool, "max_connections", None)
    if not tasks or "max_connections" in config.redis_options or not isinstance(limit, int):
        return
    if type(pool) is redis.ConnectionPool and limit < tasks + SPARE_CONNECTIONS:
        pool.max_connections = tasks + SPARE_CONNECTIONS


def reset(app: Celery) -> None:
    """Forget the app's cached config and client (after changing ``app.conf`` in tests)."""
    app = _real_app(app)
    with _lock:
        _configs.pop(app, None)
        cached = _clients.pop(app, None)
    if cached is not None and cached[0] == os.getpid():
        cached[1].close()


def _after_fork_in_child() -> None:
    # A fork copies the lock in whatever state another thread left it; give the child a fresh one.
    global _lock  # noqa: PLW0603
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
