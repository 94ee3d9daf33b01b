"""What every part of the core shares about a redis-py client: its type and its timeouts.

A blocking command (BLPOP, WAIT) that times out is answered on the server's next timer tick,
up to ``1 / hz`` seconds late (100 ms at the default ``hz 10``), and the reply must still
arrive before the client's socket timeout. :func:`blocking_wait_cap` leaves that margin: at
least :data:`MIN_BLOCKING_MARGIN`, and one tick (read once per client from ``INFO server``)
plus :data:`TICK_SLACK`. Where nothing is left it is 0: do not block at all, poll
(:func:`pop_within` does).
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import time
import weakref
from typing import Any

import redis
from redis.cluster import RedisCluster

from celery_redsem.core.errors import ConfigurationError

__all__ = [
    "DEFAULT_IDLE_TTL",
    "DEFAULT_LEASE",
    "DEFAULT_REPLICA_TIMEOUT",
    "MIN_BLOCKING_MARGIN",
    "POLL_INTERVAL",
    "TICK_SLACK",
    "RedisClient",
    "blocking_wait_cap",
    "pop_within",
    "server_tick",
    "socket_timeout",
    "to_ms",
    "validate_client",
]

#: The clients the core works with: a server (also Sentinel's ``master_for``) or a cluster.
RedisClient = redis.Redis | RedisCluster

#: Seconds a permit lives without a refresh, unless told otherwise.
DEFAULT_LEASE = 10.0
#: Seconds an idle semaphore's keys outlive their last lease.
DEFAULT_IDLE_TTL = 60.0
#: Seconds a grant waits for replica acknowledgements (``min_replicas``).
DEFAULT_REPLICA_TIMEOUT = 0.5
#: Seconds a blocking command's wait always stays below the socket timeout.
MIN_BLOCKING_MARGIN = 0.25
#: Seconds allowed, beyond one server tick, for the reply of a timed-out blocking command to
#: reach the client (scheduling on a busy host, the network).
TICK_SLACK = 0.15
#: The server's tick when it cannot be read (``hz 10``, the default).
DEFAULT_TICK = 0.1
#: Seconds between non-blocking looks when no blocking wait fits in the socket timeout.
POLL_INTERVAL = 0.05


def to_ms(seconds: float) -> int:
    """``seconds`` as whole milliseconds, rounded up, at least 1 (what the scripts take)."""
    return max(1, math.ceil(seconds * 1000))


def validate_client(client: object) -> RedisClient:
    """``client`` if it is a client the core works with, else a ConfigurationError."""
    if not isinstance(client, redis.Redis | RedisCluster):
        raise ConfigurationError(
            f"client must be a redis.Redis or redis.cluster.RedisCluster, got "
            f"{type(client).__module__}.{type(client).__qualname__}; "
            "create one with redis.Redis.from_url('redis://host:6379/0')"
        )
    return client


def socket_timeout(client: RedisClient) -> float | None:
    """The socket timeout ``client``'s connections use, in seconds (None: none).

    One the client was not given is the connection class's own default: none before
    redis-py 8, 5 s from 8 on (so a blocking wait on ``redis.Redis.from_url(url)`` is capped
    below it, not cut short by it).
    """
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()  # type: ignore[no-untyped-call]
        connection_class = kwargs.get("connection_class", redis.Connection)
    else:
        kwargs = client.connection_pool.connection_kwargs
        connection_class = client.connection_pool.connection_class
    if "socket_timeout" in kwargs:
        value = kwargs["socket_timeout"]
    else:
        value = _default_socket_timeout(connection_class)
    return float(value) if value else None


@functools.cache
def _default_socket_timeout(connection_class: type) -> float | None:
    """The ``socket_timeout`` default of ``connection_class`` (or of the first class in its
    MRO whose ``__init__`` names one); None if none is found."""
    for cls in connection_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameter = inspect.signature(init).parameters.get("socket_timeout")
        except (TypeError, ValueError):
            continue
        if parameter is not None:
            default = parameter.default
            valid = isinstance(default, int | float) and not isinstance(default, bool)
            return float(default) if valid and default > 0 else None
    return None


_ticks: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
_ticks_lock = threading.Lock()


def server_tick(client: RedisClient) -> float:
    """Seconds between the server's timer ticks (``1 / configured_hz``), read with ``INFO
    server`` on first use and remembered for ``client``; :data:`DEFAULT_TICK` if the server
    does not tell (or refuses ``INFO``). Not remembered after a connection error."""
    with _ticks_lock:
        tick = _ticks.get(client)
    if tick is not None:
        return tick
    try:
        info = client.info("server")
    except (redis.ConnectionError, redis.TimeoutError):
        return DEFAULT_TICK
    except redis.RedisError:  # refused (ACL): the default, from now on
        info = {}
    if isinstance(client, RedisCluster) and info and "hz" not in info:
        info = next(iter(info.values()), {})  # per node; they share a configuration
    try:
        hz = float(info.get("configured_hz") or info.get("hz") or 0)
    except (TypeError, ValueError):
        hz = 0.0
    tick = 1 / hz if hz > 0 else DEFAULT_TICK
    with _ticks_lock:
        _ticks[client] = tick
    return tick


def blocking_wait_cap(client: RedisClient) -> float:
    """Seconds a blocking command (BLPOP, WAIT) may wait on ``client`` and still be answered
    before its socket timeout: the timeout less ``max(MIN_BLOCKING_MARGIN, tick + TICK_SLACK)``
    (``inf`` without a socket timeout). **0.0 means: do not block** (``BLPOP`` with timeout 0
    would wait forever); see :func:`pop_within`."""
    timeout = socket_timeout(client)
    if timeout is None:
        return math.inf
    margin = max(MIN_BLOCKING_MARGIN, server_tick(client) + TICK_SLACK)
    cap = timeout - margin
    return cap if cap >= 0.01 else 0.0


def pop_within(client: RedisClient, key: str, seconds: float) -> Any:
    """Pop the first element of list ``key``, waiting at most ``seconds`` for one: ``BLPOP``
    capped by :func:`blocking_wait_cap`, or where no blocking wait fits, one ``LPOP`` and a
    local sleep of up to :data:`POLL_INTERVAL`. The element, or None. Redis errors propagate."""
    cap = blocking_wait_cap(client)
    if cap > 0:
        reply = client.blpop([key], timeout=max(0.001, min(seconds, cap)))
        return None if reply is None else reply[1]
    value = client.lpop(key)
    if value is None and seconds > 0:
        time.sleep(min(seconds, POLL_INTERVAL))
    return value
