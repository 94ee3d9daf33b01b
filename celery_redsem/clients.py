"""Build a Redis client from a URL: the one place that knows URL schemes.

``redis://``, ``rediss://`` (TLS) and ``unix://`` give a ``redis.Redis``.
"""

from __future__ import annotations

from typing import Any

import redis

from .errors import ConfigurationError
from .semaphore import RedisClient

__all__ = ["client_from_url", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, safe for logs and error messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def client_from_url(url: str, **options: Any) -> RedisClient:
    """A new client for ``url``; ``options`` are passed to redis-py (e.g. ``socket_timeout``)."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"Redis URL must be a non-empty str, got {url!r}")
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        return redis.Redis.from_url(url, **options)
    raise ConfigurationError(
        f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)!r}; "
        "use redis://, rediss:// or unix://"
    )
