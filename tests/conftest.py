"""Shared fixtures: one real Redis-protocol server per test session, a fresh key prefix per test."""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.servers import test_server_url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the real server every integration test talks to."""
    with test_server_url() as url:
        yield url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the test server (bytes replies, as redis-py defaults)."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted (by SCAN, never FLUSH) afterwards."""
    value = f"redsemtest-{uuid.uuid4().hex[:12]}"
    yield value
    for key in redis_client.scan_iter(match=f"{value}:*", count=500):
        redis_client.delete(key)


@pytest.fixture(autouse=True, scope="module")
def _collect_after_each_module() -> Iterator[None]:
    """Collect garbage as each test module ends, so that a socket or process a module leaves
    open is reported there (``filterwarnings = error``), not in whichever test the collector
    happens to run in next (with several test processes, a different one each time)."""
    yield
    gc.collect()
