"""Fair share by group in the asyncio semaphore: the same API, scripts and line as the sync one."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis.asyncio

from celery_redsem import ConfigurationError, FairSemaphore, Permit, Waiting
from celery_redsem.asyncio import FairSemaphore as AsyncFairSemaphore


def test_async_and_sync_callers_share_one_fair_line(redis_url, redis_client, prefix):
    sync_sem = FairSemaphore(redis_client, "fair", 1, prefix=prefix, grouped=True, lease=30)

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            sem = AsyncFairSemaphore(client, "fair", 1, prefix=prefix, grouped=True, lease=30)
            held = await sem.acquire(group="a")
            assert isinstance(held, Permit)
            for i in range(3):  # a's backlog, then one of b (sync)
                assert isinstance(await sem.attempt(f"a-{i}", join_line=True, group="a"), Waiting)
            assert isinstance(sync_sem.attempt("b-0", join_line=True, group="b"), Waiting)
            groups = {g.group: g for g in await sem.groups()}
            assert (groups["a"].holders, groups["a"].waiting, groups["a"].served) == (1, 3, 1)
            assert (groups["b"].holders, groups["b"].waiting, groups["b"].served) == (0, 1, 0)
            order: list[str] = []

            async def hold(pid: str, group: str) -> None:
                async with sem.hold(timeout=20, permit_id=pid, group=group):
                    order.append(pid)

            tasks = [asyncio.create_task(hold(f"a-{i}", "a")) for i in range(3)]
            tasks.append(asyncio.create_task(asyncio.to_thread(sync_hold, sync_sem, order)))
            assert await sem.release(held)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert order == ["b-0", "a-0", "a-1", "a-2"]
            assert await sem.groups() == []  # nobody holds or waits
        finally:
            await client.aclose()

    asyncio.run(main())


def sync_hold(sem: FairSemaphore, order: list[str]) -> None:
    with sem.hold(timeout=20, permit_id="b-0", group="b"):
        order.append("b-0")


def test_async_group_limit_and_weights(redis_url, prefix):
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            sem = AsyncFairSemaphore(
                client, "capped", 3, prefix=prefix, grouped=True, group_limit=1, lease=30
            )
            results = [await sem.attempt(f"a-{i}", join_line=True, group="a") for i in range(2)]
            assert [type(r) for r in results] == [Permit, Waiting]
            b = await sem.attempt("b-0", group="b", weight=2.5)
            assert isinstance(b, Permit)
            assert await sem.attempt("b-1", group="b", weight=2.5) == Waiting("b-1", "capped", 0, 0)
            groups = {g.group: g for g in await sem.groups()}
            assert groups["b"].weight == 2.5
            assert groups["b"].share == pytest.approx(1 / 2.5)
            assert (groups["a"].holders, groups["a"].waiting, groups["a"].at_limit) == (1, 1, True)
            with pytest.raises(ConfigurationError, match="needs a group"):
                await sem.attempt("x")
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_cancelled_async_waiter_leaves_its_group(redis_url, prefix):
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            sem = AsyncFairSemaphore(client, "cancel", 1, prefix=prefix, grouped=True, lease=30)
            held = await sem.acquire(group="a")
            assert held is not None
            task = asyncio.create_task(sem.acquire(blocking=True, permit_id="w", group="b"))

            async def waiting() -> Counter[str]:
                return Counter({g.group: g.waiting for g in await sem.groups()})

            for _ in range(500):
                if (await waiting())["b"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert (await waiting())["b"] == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await waiting())["b"] == 0
        finally:
            await client.aclose()

    asyncio.run(main())
