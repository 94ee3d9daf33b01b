"""No refresh script call takes more than REFRESH_CHUNK permits; a large batch still goes in
one round trip and gives the same answer (issue 20, item 10)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import redis

from celery_redsem import FairSemaphore, Permit, refresh_permits
from celery_redsem.core.refresh import REFRESH_CHUNK
from celery_redsem.core.scripts import REFRESH
from tests.servers import embedded_valkey

PERMITS = 3000


@pytest.fixture
def own_server() -> Iterator[redis.Redis]:
    """A server of its own, whose slow log records every command (this test reads it)."""
    with embedded_valkey() as url:
        client = redis.Redis.from_url(url)
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 100_000)
        yield client
        client.close()


def _refresh_calls(client: redis.Redis) -> list[int]:
    """How many permits each logged refresh.lua call took (EVALSHA's numkeys)."""
    entries = client.slowlog_get(100_000)
    return [
        int(e["command"].split()[2])
        for e in entries
        if e["command"].startswith(b"EVALSHA " + REFRESH.sha.encode())
    ]


def test_a_large_refresh_is_split_into_bounded_calls_with_the_same_result(
    own_server: redis.Redis,
) -> None:
    sems = [FairSemaphore(own_server, f"big{i}", 1000, lease=30) for i in range(3)]
    permits = []
    for sem in sems:
        for _ in range(PERMITS // len(sems)):
            permit = sem.acquire()
            assert isinstance(permit, Permit)
            permits.append(permit)
    gone = permits[5::401]  # released along the way: reported lost, never resurrected
    for permit in gone:
        assert sems[int(permit.name[3:])].release(permit)
    own_server.script_flush()  # the pipelined calls load the script again themselves
    own_server.slowlog_reset()

    result = refresh_permits(own_server, permits)

    assert result.lost == gone
    assert [p.id for p in result.refreshed] == [p.id for p in permits if p not in gone]
    assert all(
        new.expires_at >= old.expires_at and new.token == old.token
        for new, old in zip(result.refreshed, (p for p in permits if p not in gone), strict=True)
    )
    assert result.failed == []
    calls = _refresh_calls(own_server)
    assert max(calls) <= REFRESH_CHUNK <= 500  # a few milliseconds of server time at most
    assert len(calls) >= math.ceil(PERMITS / REFRESH_CHUNK)
    assert sum(calls) >= PERMITS  # every permit was in a call (some twice: NOSCRIPT)
    held = sum(len(s.state().holders) for s in sems)
    assert held == PERMITS - len(gone)


def test_a_small_refresh_is_still_one_call(own_server: redis.Redis) -> None:
    sem = FairSemaphore(own_server, "small", 5, lease=30)
    permits = [sem.acquire() for _ in range(5)]
    own_server.script_load(REFRESH.source)  # no NOSCRIPT round on a new server
    own_server.slowlog_reset()
    result = refresh_permits(own_server, permits)  # type: ignore[arg-type]
    assert len(result.refreshed) == 5
    assert _refresh_calls(own_server) == [5]
