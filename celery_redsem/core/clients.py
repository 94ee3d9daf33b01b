"""Build a Redis client from a URL: the one place that knows URL schemes.

============================================================  ==================================
URL                                                           client
============================================================  ==================================
``redis://[user:password@]host:port/db``                      ``redis.Redis``
``rediss://...`` (TLS; ``?ssl_ca_certs=...`` etc.)            ``redis.Redis`` over TLS
``unix:///path/to/socket?db=0``                               ``redis.Redis``
``redis+cluster://[user:password@]host:port[,host:port...]``  ``redis.cluster.RedisCluster``
``rediss+cluster://...`` (TLS)                                ``RedisCluster`` over TLS
``sentinel://[user:password@]host:26379[/db];sentinel://...`` ``redis.Redis`` on the primary
============================================================  ==================================

Sentinel URLs are written as Celery's and kombu's ``sentinel://`` result backend and broker
take them: one ``sentinel://`` address per Sentinel, separated by ``;``. The user, password and
database of the first one are used for the *primary*; the Sentinels themselves are reached
with ``sentinel_kwargs``. Options that apply only to Sentinel (Celery's transport options):

- ``master_name`` (required): the name the Sentinels monitor the primary under
  (also accepted as ``?master_name=`` in the URL);
- ``sentinel_kwargs``: redis-py arguments for the Sentinel connections, e.g. their password;
- ``min_other_sentinels``: how many other Sentinels a Sentinel must see to be trusted.

``ssl=True`` (plus ``ssl_ca_certs`` ...) makes the connections to the primary use TLS.
``ssl_cert_reqs`` takes Celery's spelling too (``CERT_REQUIRED``, ``CERT_OPTIONAL``,
``CERT_NONE``), so a result-backend URL written for Celery works here unchanged.
Every other option is passed to redis-py unchanged (e.g. ``socket_timeout``). Passwords never
appear in an error message: URLs and options go through :mod:`celery_redsem.core.redaction`
(:func:`redact_url` replaces a password with ``***``).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url, to_bool
from redis.exceptions import RedisClusterException

from celery_redsem.core.client import RedisClient
from celery_redsem.core.errors import BackendError, ConfigurationError
from celery_redsem.core.redaction import redact_url, safe_repr, scrub

__all__ = ["CLUSTER_SCHEMES", "SENTINEL_OPTIONS", "client_from_url", "redact_url", "scrub"]

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_OPTIONS = ("master_name", "sentinel_kwargs", "min_other_sentinels")
_PLAIN_SCHEMES = ("redis", "rediss", "unix")
# Celery's documentation writes ``?ssl_cert_reqs=CERT_REQUIRED``; redis-py takes ``required``.
_CELERY_CERT_REQS = re.compile(r"(?i)([?&]ssl_cert_reqs=)CERT_(REQUIRED|OPTIONAL|NONE)(?=[&#;]|$)")


def client_from_url(url: str, **options: Any) -> RedisClient:
    """A new client for ``url`` (see the module docs); ``options`` go to redis-py.

    Raises :class:`ConfigurationError` for a malformed URL or options, and
    :class:`BackendError` if a cluster cannot be reached to learn its layout.
    """
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"Redis URL must be a non-empty str, got {safe_repr(url)}")
    scheme = url.split("://", 1)[0].lower()
    url = _CELERY_CERT_REQS.sub(lambda m: m.group(1) + m.group(2).lower(), url)
    misplaced = [name for name in SENTINEL_OPTIONS if name in options]
    if scheme != "sentinel" and misplaced:
        raise ConfigurationError(
            f"option(s) {', '.join(misplaced)} only apply to sentinel:// URLs, "
            f"not {redact_url(url)!r}"
        )
    if "://" not in url:
        raise ConfigurationError(
            f"Redis URL {redact_url(url)!r} has no scheme; write it as redis://host:port/db "
            "(or rediss://, unix://, redis+cluster://, rediss+cluster://, sentinel://)"
        )
    try:
        if scheme in _PLAIN_SCHEMES:
            return _checked(redis.Redis.from_url(url, **options))
        if scheme in CLUSTER_SCHEMES:
            return _cluster_client(url, **options)
        if scheme == "sentinel":
            return _checked(_sentinel_client(url, **options))
    except RedisClusterException as exc:
        reason = scrub(str(exc), url, options)
        raise BackendError(f"cannot reach the cluster at {redact_url(url)!r}: {reason}") from exc
    except redis.RedisError as exc:
        raise BackendError(
            f"Redis failed for {redact_url(url)!r}: {scrub(str(exc), url, options)}"
        ) from exc
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigurationError):
            raise
        reason = scrub(str(exc), url, options)
        raise ConfigurationError(
            f"bad Redis URL or option for {redact_url(url)!r}: {reason}"
        ) from exc
    raise ConfigurationError(
        f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)!r}; use redis://, "
        "rediss://, unix://, redis+cluster://, rediss+cluster:// or sentinel://"
    )


def _checked(client: redis.Redis) -> redis.Redis:
    """``client``, once one connection object is made from its options (no I/O): redis-py
    checks them only then, which would otherwise be at the first command, in a task."""
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except redis.RedisError as exc:  # e.g. an unknown ssl_cert_reqs value
        raise ValueError(str(exc)) from exc
    return client


def _split_hosts(netloc_hosts: str, default_port: int, url: str) -> list[tuple[str, int]]:
    nodes = []
    for item in netloc_hosts.split(","):
        parts = urlsplit(f"//{item.strip()}")
        if not parts.hostname:
            raise ConfigurationError(f"missing host in {redact_url(url)!r}")
        nodes.append((unquote(parts.hostname), parts.port or default_port))
    return nodes


def _cluster_client(url: str, **options: Any) -> RedisCluster:
    """``redis+cluster://[user:pass@]h1:p1,h2:p2[/0][?opts]``: every host is a startup node."""
    scheme, rest = url.split("://", 1)
    parts = urlsplit(f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}")
    if parts.path not in ("", "/", "/0"):
        raise ConfigurationError(f"Redis Cluster has only database 0: {redact_url(url)!r}")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    (host, port), *others = _split_hosts(hosts, 6379, url)
    address = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
    first = urlunsplit((parts.scheme, f"{userinfo}{at}{address}:{port}", "", parts.query, ""))
    startup = [ClusterNode(h, p) for h, p in others]  # type: ignore[no-untyped-call]
    return RedisCluster(url=first, startup_nodes=startup, **options)


def _sentinel_client(url: str, **options: Any) -> redis.Redis:
    """``sentinel://[user:pass@]h1:26379[/db];sentinel://h2:26379`` as Celery writes it."""
    from redis.sentinel import Sentinel

    chunks = [chunk.strip() for chunk in url.split(";") if chunk.strip()]
    sentinels: list[tuple[str, int]] = []
    for chunk in chunks:
        if not chunk.lower().startswith("sentinel://"):
            raise ConfigurationError(
                f"every address in a Sentinel URL must be sentinel://, got {redact_url(chunk)!r}"
            )
        parts = urlsplit(chunk)
        sentinels += _split_hosts(parts.netloc.rpartition("@")[2], 26379, url)
    first = urlsplit(chunks[0])
    query = dict(parse_qsl(first.query))
    query.pop("master_name", None)
    master_name = options.pop("master_name", None)
    for chunk in chunks:  # ``?master_name=`` may follow any address, usually the last
        master_name = master_name or dict(parse_qsl(urlsplit(chunk).query)).get("master_name")
    if not master_name:
        raise ConfigurationError(
            f"a sentinel:// URL needs the option master_name (the name the Sentinels monitor "
            f"the primary under), as in Celery's transport options: {redact_url(url)!r}"
        )
    # The first address's user, password, db and query options are for the primary.
    primary_url = urlunsplit(("redis", first.netloc, first.path, urlencode(query), ""))
    connection_kwargs = {
        key: value
        for key, value in parse_url(primary_url).items()  # type: ignore[no-untyped-call]
        if key not in ("host", "port", "connection_class")
    }
    connection_kwargs.update(options)
    # A query string gives strings; redis-py would compare or test them as they are.
    if isinstance(connection_kwargs.get("ssl"), str):
        connection_kwargs["ssl"] = bool(to_bool(connection_kwargs["ssl"]))  # type: ignore[no-untyped-call]
    min_other = connection_kwargs.pop("min_other_sentinels", 0)
    if isinstance(min_other, str) and min_other.isdigit():
        min_other = int(min_other)
    if not isinstance(min_other, int) or isinstance(min_other, bool) or min_other < 0:
        raise ConfigurationError(
            f"min_other_sentinels must be an int >= 0, got {safe_repr(min_other)}"
        )
    manager = Sentinel(  # type: ignore[no-untyped-call]
        sentinels,
        min_other_sentinels=min_other,
        # None: the Sentinels get only the socket_* options, never the primary's password.
        sentinel_kwargs=connection_kwargs.pop("sentinel_kwargs", None),
        **connection_kwargs,
    )
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]
        str(master_name), redis_class=redis.Redis
    )
    return client
