"""The asyncio semaphore on a real 3-primary Redis Cluster (``redis.asyncio.cluster``), in one
line with sync cluster callers."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from celery_redsem import Lock
from celery_redsem.asyncio import FairSemaphore as AsyncFairSemaphore
from celery_redsem.asyncio import Lock as AsyncLock
from celery_redsem.core.keys import SemaphoreKeys
from tests.servers import HOST, Cluster

pytestmark = pytest.mark.slow


def test_async_cluster_callers_share_limits_wake_ups_and_tokens_with_sync_ones(
    cluster: Cluster, cluster_client, prefix
):
    names = [f"acct:{i}" for i in range(6)]  # spread over the nodes
    nodes = {
        str(cluster_client.get_node_from_key(SemaphoreKeys(prefix, n).holders).name) for n in names
    }
    assert len(nodes) > 1
    sync_locks = [Lock(cluster_client, n, prefix=prefix, waiter_lease=30) for n in names]
    inside: dict[str, int] = dict.fromkeys(names, 0)
    most = 0

    async def worker(sem: AsyncFairSemaphore) -> None:
        nonlocal most
        async with sem.hold(timeout=30, keep_alive=True):
            inside[sem.name] += 1
            most = max(most, inside[sem.name])
            await asyncio.sleep(0.002)
            inside[sem.name] -= 1

    async def main() -> None:
        client = AsyncRedisCluster(host=HOST, port=cluster.nodes[0].port)
        try:
            locks = [AsyncLock(client, n, prefix=prefix, waiter_lease=30) for n in names]
            await asyncio.gather(*(worker(lock) for lock in locks for _ in range(5)))
            for sync_lock, lock in zip(sync_locks, locks, strict=True):
                held = sync_lock.acquire()
                assert held is not None
                assert await lock.locked()
                waiting = asyncio.create_task(lock.acquire(blocking=True, timeout=20))
                deadline = time.monotonic() + 5
                while not await lock.waiters():
                    assert time.monotonic() < deadline, "the async waiter never got in line"
                    await asyncio.sleep(0.01)
                started = time.monotonic()
                sync_lock.release(held)
                mine = await waiting
                assert mine is not None
                assert mine.token > held.token
                assert time.monotonic() - started < 3  # woken, not at the end of a 10 s round
                assert await lock.release(mine)
        finally:
            await client.aclose()

    asyncio.run(main())
    assert most == 1
