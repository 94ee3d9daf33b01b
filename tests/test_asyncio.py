"""The asyncio semaphore on a real server, side by side with the sync one: one line, one limit,
one sequence of fencing tokens, the same wake-ups. Coroutines run under ``asyncio.run``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio

from celery_redsem import AcquireTimeout, ConfigurationError, FairSemaphore, Lock, PermitLost
from celery_redsem import Permit as SyncPermit
from celery_redsem.asyncio import FairSemaphore as AsyncFairSemaphore
from celery_redsem.asyncio import Lock as AsyncLock
from celery_redsem.core.scripts import ACQUIRE

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


@asynccontextmanager
async def async_client(url: str, **kwargs: Any) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(url, **kwargs)
    try:
        yield client
    finally:
        await client.aclose()


async def eventually(condition: Callable[[], Awaitable[object]], timeout: float, what: str) -> None:
    """Poll ``condition`` until it is truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def waiters_in_line(sem: AsyncFairSemaphore, n: int, what: str) -> None:
    """Wait (at most 5 s) until ``sem`` has ``n`` waiters in line."""

    async def in_line() -> bool:
        return len(await sem.waiters()) == n

    await eventually(in_line, 5, what)


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_lock_held_by_a_sync_caller_refuses_an_async_caller_and_back(
    redis_url, redis_client, prefix
):
    sync_lock = Lock(redis_client, "report", prefix=prefix)

    async def main() -> None:
        async with async_client(redis_url) as client:
            async_lock = AsyncLock(client, "report", prefix=prefix)
            held = sync_lock.acquire()
            assert held is not None
            assert await async_lock.acquire() is None
            assert await async_lock.acquire(blocking=True, timeout=0.1) is None
            assert await async_lock.locked()
            assert sync_lock.release(held)
            assert not await async_lock.locked()

            mine = await async_lock.acquire()
            assert mine is not None
            assert sync_lock.acquire() is None
            assert sync_lock.acquire(blocking=True, timeout=0.1) is None
            assert sync_lock.locked()
            assert await async_lock.release(mine)
            assert not sync_lock.locked()
            assert await async_lock.waiters() == []

    run(main())


def test_forty_coroutines_on_limit_three_never_exceed_three_and_all_finish(redis_url, prefix):
    inside = 0
    most = 0
    finished: list[int] = []

    async def worker(sem: AsyncFairSemaphore, i: int) -> None:
        nonlocal inside, most
        async with sem.hold(timeout=30):
            inside += 1  # an independent counter: the semaphore never sees it
            most = max(most, inside)
            await asyncio.sleep(0.002)
            inside -= 1
        finished.append(i)

    async def main() -> None:
        async with async_client(redis_url) as client:
            sem = AsyncFairSemaphore(client, "crowd", 3, prefix=prefix, lease=5)
            await asyncio.gather(*(worker(sem, i) for i in range(40)))
            assert await sem.holders() == []
            assert await sem.waiters() == []

    run(main())
    assert sorted(finished) == list(range(40))
    assert most == 3


async def served_in_turn(lock: AsyncLock, i: int, served: list[int]) -> None:
    """Wait for ``lock``, note ``i`` in ``served``, give the lock back."""
    permit = await lock.acquire(blocking=True, timeout=20)
    assert permit is not None
    served.append(i)
    await lock.release(permit)


def test_five_async_waiters_are_served_in_arrival_order(redis_url, redis_client, prefix):
    served: list[int] = []

    async def waiter(lock: AsyncLock, i: int) -> None:
        await served_in_turn(lock, i, served)

    async def main() -> None:
        async with async_client(redis_url) as client:
            lock = AsyncLock(client, "line", prefix=prefix, waiter_lease=30)
            holder = await lock.acquire()
            assert holder is not None
            tasks = []
            for i in range(5):
                tasks.append(asyncio.create_task(waiter(lock, i)))
                await waiters_in_line(lock, i + 1, f"waiter {i} in line")
            started = time.monotonic()
            await lock.release(holder)
            await asyncio.gather(*tasks)
            # Each was woken by the release before it, not by its 10 s round ending.
            assert time.monotonic() - started < 5

    run(main())
    assert served == [0, 1, 2, 3, 4]


def test_fencing_tokens_keep_increasing_across_sync_and_async_grants(
    redis_url, redis_client, prefix
):
    sync_lock = Lock(redis_client, "fenced", prefix=prefix)
    tokens: list[int] = []

    async def main() -> None:
        async with async_client(redis_url) as client:
            async_lock = AsyncLock(client, "fenced", prefix=prefix)
            for _ in range(4):
                permit = sync_lock.acquire()
                assert permit is not None
                tokens.append(permit.token)
                sync_lock.release(permit)
                async with async_lock.hold(timeout=5) as held:
                    tokens.append(held.token)

    run(main())
    assert tokens == sorted(set(tokens))
    assert len(tokens) == 8


def test_sync_and_async_waiters_are_woken_by_each_others_release(redis_url, redis_client, prefix):
    """Rounds of 10 s (waiter lease 30 s): a grant within seconds came from the wake-up list."""
    sync_lock = Lock(redis_client, "wake", prefix=prefix, waiter_lease=30)

    async def main() -> None:
        async with async_client(redis_url) as client:
            async_lock = AsyncLock(client, "wake", prefix=prefix, waiter_lease=30)
            held = sync_lock.acquire()
            assert held is not None
            waiting = asyncio.create_task(async_lock.acquire(blocking=True, timeout=20))
            await waiters_in_line(async_lock, 1, "the async waiter in line")
            started = time.monotonic()
            sync_lock.release(held)
            mine = await waiting
            assert mine is not None
            assert time.monotonic() - started < 3

            blocked = asyncio.create_task(
                asyncio.to_thread(sync_lock.acquire, blocking=True, timeout=20)
            )
            await waiters_in_line(async_lock, 1, "the sync waiter in line")
            started = time.monotonic()
            await async_lock.release(mine)
            theirs = await blocked
            assert isinstance(theirs, SyncPermit)
            assert time.monotonic() - started < 3
            sync_lock.release(theirs)

    run(main())


def test_a_blocking_wait_takes_no_connection_from_the_clients_pool(redis_url, prefix):
    """A pool of one connection: a waiter's BLPOP on it would keep the release out."""

    async def main() -> None:
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            redis_url, max_connections=1, timeout=5
        )
        client = redis.asyncio.Redis.from_pool(pool)  # closes the pool with it
        try:
            lock = AsyncLock(client, "pool", prefix=prefix, waiter_lease=30)
            held = await lock.acquire()
            assert held is not None
            waiting = asyncio.create_task(lock.acquire(blocking=True, timeout=20))
            await waiters_in_line(lock, 1, "the waiter in line")
            started = time.monotonic()
            assert await client.ping()  # the pool's one connection is free while it waits
            assert await lock.release(held)
            mine = await waiting
            assert mine is not None
            assert time.monotonic() - started < 3
            await lock.release(mine)
        finally:
            await client.aclose()

    run(main())


def test_hold_keep_alive_renews_a_short_lease_from_an_asyncio_task(redis_url, redis_client, prefix):
    async def main() -> None:
        async with async_client(redis_url) as client:
            lock = AsyncLock(client, "renewed", prefix=prefix, lease=0.6)
            async with lock.hold(keep_alive=True) as permit:

                async def two_leases_passed() -> bool:
                    return server_ms(redis_client) > permit.expires_at + 1200

                await eventually(two_leases_passed, 10, "two leases to pass")
                [holder] = await lock.holders()
                assert (holder.permit_id, holder.token) == (permit.id, permit.token)
                assert holder.expires_at > permit.expires_at
            assert not await lock.locked()

    run(main())


def test_a_renewal_starved_by_a_busy_event_loop_raises_permit_lost_on_leaving(
    redis_url, prefix, caplog
):
    async def main() -> None:
        async with async_client(redis_url) as client:
            lock = AsyncLock(client, "starved", prefix=prefix, lease=0.3)
            with pytest.raises(PermitLost, match="lost before the block ended"):
                async with lock.hold(keep_alive=True):
                    time.sleep(0.5)  # blocks the event loop: the renewal cannot run in time
            assert not await lock.locked()

    with caplog.at_level(logging.WARNING, logger="celery_redsem.asyncio"):
        run(main())
    assert "past its lease: the event loop was busy" in caplog.text


def test_an_async_waiter_that_times_out_or_is_cancelled_leaves_the_line(
    redis_url, redis_client, prefix
):
    sync_lock = Lock(redis_client, "given-up", prefix=prefix)
    held = sync_lock.acquire()
    assert held is not None

    async def main() -> None:
        async with async_client(redis_url) as client:
            lock = AsyncLock(client, "given-up", prefix=prefix)
            with pytest.raises(AcquireTimeout, match=r"within 0\.2s"):
                async with lock.hold(timeout=0.2):
                    pass
            assert await lock.waiters() == []
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(lock.acquire(blocking=True, permit_id="gone"), 0.3)
            assert await lock.waiters() == []
            assert [h.permit_id for h in await lock.holders()] == [held.id]

    run(main())
    sync_lock.release(held)


@pytest.mark.skipif(
    not hasattr(asyncio.Task, "cancelling"), reason="Python 3.10 tasks do not count cancellations"
)
def test_a_blocking_acquire_cancelled_at_any_point_ends_cancelled_at_once(redis_url, prefix):
    """redis-py sends through ``asyncio.wait_for``, which before Python 3.12 swallows a
    cancellation that arrives as the send completes: the acquire went on waiting (here, until
    the holder's 30 s lease ran out). Cancelled at spread-out points of its first round trips,
    every acquire must end cancelled, promptly, and out of the line."""

    async def main() -> None:
        async with async_client(redis_url) as client:
            sem = AsyncFairSemaphore(client, "cut", 1, prefix=prefix, lease=30)
            assert await sem.acquire() is not None
            for i in range(120):
                task = asyncio.create_task(sem.acquire(blocking=True, permit_id=f"w{i}"))
                for _ in range(i % 7):
                    await asyncio.sleep(0)
                await asyncio.sleep((i % 11) * 0.0002)
                task.cancel()
                done, _ = await asyncio.wait([task], timeout=2)
                assert done, f"acquire {i} went on waiting after its cancellation"
                assert task.cancelled(), f"acquire {i} ended with {task.result()!r}"
            await eventually(lambda: _no_waiters(sem), 2, "the cancelled waiters to leave")

    run(main())


async def _no_waiters(sem: AsyncFairSemaphore) -> bool:
    return await sem.waiters() == []


def test_async_refresh_extends_by_a_given_lease_and_reports_a_lost_permit(
    redis_url, redis_client, prefix
):
    async def main() -> None:
        async with async_client(redis_url) as client:
            sem = AsyncFairSemaphore(client, "refresh", 2, prefix=prefix, lease=1)
            permit = await sem.acquire()
            assert permit is not None
            longer = await sem.refresh(permit, lease=60)
            assert longer.lease == 60.0
            assert longer.expires_at - server_ms(redis_client) > 50_000
            assert (await sem.refresh(longer)).lease == 60.0
            with pytest.raises(ConfigurationError, match="lease must be"):
                await sem.refresh(longer, lease=-1)
            assert await sem.release(longer)
            with pytest.raises(PermitLost):
                await sem.refresh(longer)

    run(main())


def test_the_async_semaphore_reloads_its_scripts_after_a_flush(redis_url, redis_client, prefix):
    async def main() -> None:
        async with async_client(redis_url, decode_responses=True) as client:
            sem = AsyncFairSemaphore(client, "flushed", 1, prefix=prefix)
            redis_client.script_flush()
            assert not redis_client.script_exists(ACQUIRE.sha)[0]
            permit = await sem.acquire()
            assert permit is not None
            assert await sem.release(permit)

    run(main())


def test_each_side_refuses_the_other_sides_client(redis_url, redis_client):
    with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis"):
        AsyncFairSemaphore(redis_client, "x", 1)  # type: ignore[arg-type]

    async def main() -> None:
        async with async_client(redis_url) as client:
            with pytest.raises(ConfigurationError, match=r"must be a redis\.Redis"):
                FairSemaphore(client, "x", 1)  # type: ignore[arg-type]

    run(main())


def test_sync_and_async_waiters_share_one_line_in_arrival_order(redis_url, redis_client, prefix):
    """Waiters of both kinds, alternating: served first come, first served, each woken by the
    release before it."""
    sync_lock = Lock(redis_client, "mixed", prefix=prefix, waiter_lease=30)
    served: list[int] = []

    def sync_waiter(i: int) -> None:
        client = redis.Redis.from_url(redis_url)  # a thread's own client
        try:
            lock = Lock(client, "mixed", prefix=prefix, waiter_lease=30)
            permit = lock.acquire(blocking=True, timeout=20)
            assert permit is not None
            served.append(i)
            lock.release(permit)
        finally:
            client.close()

    async def async_waiter(lock: AsyncLock, i: int) -> None:
        await served_in_turn(lock, i, served)

    async def main() -> None:
        async with async_client(redis_url) as client:
            lock = AsyncLock(client, "mixed", prefix=prefix, waiter_lease=30)
            holder = sync_lock.acquire()
            assert holder is not None
            waiting = []
            for i in range(6):
                if i % 2:
                    waiting.append(asyncio.create_task(asyncio.to_thread(sync_waiter, i)))
                else:
                    waiting.append(asyncio.create_task(async_waiter(lock, i)))
                await waiters_in_line(lock, i + 1, f"waiter {i} in line")
            started = time.monotonic()
            sync_lock.release(holder)
            await asyncio.gather(*waiting)
            assert time.monotonic() - started < 5  # woken, not at the end of 10 s rounds

    run(main())
    assert served == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("keep_alive", [True, False])
def test_a_hold_cancelled_as_it_ends_still_releases_its_permit(redis_url, prefix, keep_alive):
    """The cancellation reaches ``hold`` as it leaves (stopping the renewal, or releasing on a
    new connection): the permit is given back all the same, not kept for its lease."""

    async def main() -> None:
        async with async_client(redis_url) as client:
            lock = AsyncLock(client, "cancelled", prefix=prefix, lease=30)

            async def holder() -> None:
                async with lock.hold(keep_alive=keep_alive):
                    current = asyncio.current_task()
                    assert current is not None
                    await client.connection_pool.disconnect()  # the release must connect
                    current.cancel()  # delivered at the block's first await: its exit

            with pytest.raises(asyncio.CancelledError):
                await asyncio.create_task(holder())

            async def released() -> bool:
                return not await lock.locked()

            await eventually(released, 5, "the permit given back")

    run(main())


def test_a_valkey_py_asyncio_client_is_refused_with_a_clear_error(redis_url):
    valkey_asyncio = pytest.importorskip("valkey.asyncio")

    async def main() -> None:
        client = valkey_asyncio.Valkey.from_url(redis_url)
        try:
            with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis.*valkey"):
                AsyncLock(client, "valkey")  # type: ignore[arg-type]
        finally:
            await client.aclose()

    run(main())
