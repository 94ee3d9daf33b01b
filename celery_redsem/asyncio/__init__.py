"""The semaphore, the lock and the rate limiter for asyncio code (``redis.asyncio``
clients), without Celery.

Same scripts, keys and semantics as :class:`celery_redsem.FairSemaphore` and
:class:`celery_redsem.Lock`: sync and async callers of one name share its limit, its FIFO
line, its wake-ups and its fencing tokens::

    from celery_redsem.asyncio import FairSemaphore

    sem = FairSemaphore(redis.asyncio.Redis(), "market:42", limit=5)
    async with sem.hold(timeout=30, keep_alive=True) as permit:
        ...
"""

from __future__ import annotations

from celery_redsem.asyncio.client import AsyncRedisClient
from celery_redsem.asyncio.rate_limit import RateLimiter
from celery_redsem.asyncio.semaphore import FairSemaphore, Lock

__all__ = ["AsyncRedisClient", "FairSemaphore", "Lock", "RateLimiter"]
