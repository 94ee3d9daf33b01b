"""What every part of the core shares about a redis-py client: its type and its timeouts."""

from __future__ import annotations

import math

import redis
from redis.cluster import RedisCluster

from celery_redsem.core.errors import ConfigurationError

__all__ = [
    "DEFAULT_IDLE_TTL",
    "DEFAULT_LEASE",
    "DEFAULT_REPLICA_TIMEOUT",
    "RedisClient",
    "blocking_wait_cap",
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
    """The socket timeout ``client``'s connections use, in seconds (None: none)."""
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()  # type: ignore[no-untyped-call]
    else:
        kwargs = client.connection_pool.connection_kwargs
    value = kwargs.get("socket_timeout")
    return float(value) if value else None


def blocking_wait_cap(client: RedisClient) -> float:
    """Seconds a blocking command (BLPOP) may wait on ``client`` without hitting its socket
    timeout: the timeout less a margin (``inf`` if it has none)."""
    timeout = socket_timeout(client)
    if timeout is None:
        return math.inf
    return max(0.01, timeout - max(0.1, 0.2 * timeout))
