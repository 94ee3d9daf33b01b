"""Pausing a semaphore's name against a real server: nothing is granted while the pause lasts
(holders renew, the fast path stays closed), it ends by TTL or resume; sync and asyncio."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio
from redis.crc import key_slot

from celery_redsem import ConfigurationError, FairSemaphore, Lock, Permit, RateLimiter, Waiting
from celery_redsem.asyncio import FairSemaphore as AsyncFairSemaphore
from celery_redsem.core.keys import SemaphoreKeys
from tests.servers import wait_until


def test_a_paused_semaphore_grants_nothing_until_resumed(
    redis_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(redis_client, "s", 3, prefix=prefix)
    other = FairSemaphore(redis_client, "t", 3, prefix=prefix)
    held = sem.acquire(permit_id="held")
    assert isinstance(held, Permit)
    assert sem.acquire(permit_id="warm") is not None  # the fast path's gate is open now
    sem.release("warm")
    assert sem.pause(30) == 30
    assert sem.pause(1) > 29  # a shorter pause leaves the longer one
    refused = sem.attempt("new", join_line=True)
    assert isinstance(refused, Waiting)
    assert refused.position == 0
    assert 29 < refused.paused <= 30
    assert sem.acquire() is None
    renewed = sem.attempt("held")  # a holder keeps (and renews) its permit
    assert isinstance(renewed, Permit)
    assert renewed.token == held.token
    assert renewed.expires_at >= held.expires_at
    assert isinstance(sem.attempt("new"), Waiting)  # the renewal did not reopen the gate
    assert sem.state().waiters == []  # a paused attempt takes no place in line
    assert other.acquire() is not None  # other names are untouched
    sem.resume()
    sem.resume()  # nothing to end: nothing happens
    assert isinstance(sem.attempt("new"), Permit)
    assert isinstance(sem.attempt("again"), Permit)


def test_a_pause_expires_with_its_ttl_and_a_blocked_caller_waits_it_out(
    redis_client: redis.Redis, prefix: str
) -> None:
    lock = Lock(redis_client, "l", prefix=prefix)
    keys = SemaphoreKeys(prefix, "l")
    assert lock.pause(1.0) == 1.0
    assert 0 < redis_client.pttl(keys.pause) <= 1000
    assert lock.acquire(blocking=True, timeout=0.2) is None  # the pause ends later than that
    started = time.monotonic()
    permit = lock.acquire(blocking=True, timeout=5)  # woken by the pause's end, not a release
    waited = time.monotonic() - started
    assert isinstance(permit, Permit)
    assert waited < 1.5
    # Expired: PTTL says 0 in the key's last millisecond, when it still exists.
    wait_until(lambda: not redis_client.exists(keys.pause), 1, what="the pause key to expire")
    with pytest.raises(ConfigurationError, match="pause seconds"):
        lock.pause(-1)


def test_a_waiter_keeps_its_place_through_a_short_pause(
    redis_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(redis_client, "w", 1, prefix=prefix)
    first = sem.acquire(permit_id="first")
    assert first is not None
    waiting = sem.attempt("second", join_line=True)
    assert isinstance(waiting, Waiting)
    assert waiting.position == 1
    sem.pause(0.3)
    sem.release(first)
    assert sem.attempt("third", join_line=True).paused > 0  # type: ignore[union-attr]
    assert [w.permit_id for w in sem.state().waiters] == ["second"]
    got: list[Permit | None] = []
    thread = threading.Thread(target=lambda: got.append(sem.acquire(True, 5, permit_id="second")))
    thread.start()
    thread.join(5)
    assert got
    assert got[0] is not None
    assert got[0].id == "second"


def test_the_pause_is_the_names_for_its_rate_limiter_too(
    redis_client: redis.Redis, prefix: str
) -> None:
    sem = FairSemaphore(redis_client, "n", 2, prefix=prefix, grouped=True)
    limiter = RateLimiter(redis_client, "n", "100/s", prefix=prefix)
    sem.pause(30)
    assert limiter.attempt().paused
    refused = sem.attempt("g", group="a")  # the fair script honours it as well
    assert isinstance(refused, Waiting)
    assert refused.paused > 29
    limiter.resume()
    assert isinstance(sem.attempt("g", group="a"), Permit)


def test_pause_keys_share_the_semaphores_cluster_slot(prefix: str) -> None:
    keys = SemaphoreKeys(prefix, "slot-me")
    assert key_slot(keys.pause.encode()) == key_slot(keys.holders.encode())


def test_asyncio_callers_pause_and_resume_the_same_semaphore(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    sync = FairSemaphore(redis_client, "as", 2, prefix=prefix)

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            sem = AsyncFairSemaphore(client, "as", 2, prefix=prefix)
            assert await sem.pause(30) == 30
            assert sync.acquire() is None
            refused = await sem.attempt("a")
            assert isinstance(refused, Waiting)
            assert refused.paused > 29
            await sem.resume()
            assert isinstance(await sem.attempt("a"), Permit)
            await sem.pause(0.2)
            started = time.monotonic()
            assert await sem.acquire(blocking=True, timeout=5) is not None
            assert time.monotonic() - started < 1.5
        finally:
            await client.aclose()

    asyncio.run(main())
