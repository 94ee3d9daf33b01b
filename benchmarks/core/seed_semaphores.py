"""The three counting semaphores of "Redis in Action" chapter 6, rebuilt for comparison.

Written from the ideas the seed documents describe, not from their code. All three take the
time from the client's ``time.time()``, as the originals do; that is the point of comparing
them with :class:`celery_redsem.FairSemaphore`, which only uses the server clock.

* :class:`BasicSemaphore`: one sorted set, member = holder id, score = client timestamp; a
  caller is in if its rank is below the limit. A client whose clock runs ahead ranks behind
  everyone and a client whose clock lags can push its way in front of a holder.
* :class:`CounterFairSemaphore`: a counter hands out increasing numbers and an "owner" sorted
  set ranks callers by them; the timestamp set is only used to expire stale holders, which are
  dropped from the owner set with ``ZINTERSTORE`` (owner weight 1, timestamp weight 0). Taking
  the number and taking the place are two separate pipelines, so two callers can both see a
  rank below the limit.
* :class:`LockedFairSemaphore`: the same, with every acquisition done while holding a short
  ``SETNX`` lock (a lock with an expiry and an owner-checked, ``WATCH``-guarded release).
"""

from __future__ import annotations

import math
import time
import uuid

import redis

__all__ = [
    "BasicSemaphore",
    "CounterFairSemaphore",
    "LockedFairSemaphore",
    "acquire_lock_with_timeout",
    "release_lock",
]


def _new_id() -> str:
    return str(uuid.uuid4())


class BasicSemaphore:
    """Sorted set of holders scored by the client clock; admitted if ranked below ``limit``."""

    def __init__(self, client: redis.Redis, name: str, limit: int, timeout: float = 10.0) -> None:
        self.client = client
        self.key = name
        self.limit = limit
        self.timeout = timeout

    def acquire(self) -> str | None:
        """Try once; return the holder id, or None (after taking our entry out again)."""
        ident = _new_id()
        now = time.time()
        with self.client.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(self.key, "-inf", now - self.timeout)
            pipe.zadd(self.key, {ident: now})
            pipe.zrank(self.key, ident)
            rank = pipe.execute()[-1]
        if rank is not None and rank < self.limit:
            return ident
        self.client.zrem(self.key, ident)
        return None

    def release(self, ident: str) -> bool:
        """Remove the holder; True if it was still there."""
        return bool(self.client.zrem(self.key, ident))


class CounterFairSemaphore:
    """Ranked by a shared counter instead of timestamps; two pipelines per acquisition."""

    def __init__(self, client: redis.Redis, name: str, limit: int, timeout: float = 10.0) -> None:
        self.client = client
        self.name = name
        self.timeouts = name
        self.owners = f"{name}:owner"
        self.counter = f"{name}:counter"
        self.limit = limit
        self.timeout = timeout

    def acquire(self) -> str | None:
        """Try once; return the holder id, or None (after removing our entries)."""
        ident = _new_id()
        now = time.time()
        with self.client.pipeline(transaction=True) as pipe:
            # Forget holders whose timestamp is too old, in both sets, then draw a number.
            pipe.zremrangebyscore(self.timeouts, "-inf", now - self.timeout)
            pipe.zinterstore(self.owners, {self.owners: 1, self.timeouts: 0})
            pipe.incr(self.counter)
            number = pipe.execute()[-1]

            pipe.zadd(self.timeouts, {ident: now})
            pipe.zadd(self.owners, {ident: number})
            pipe.zrank(self.owners, ident)
            rank = pipe.execute()[-1]
            if rank is not None and rank < self.limit:
                return ident

            pipe.zrem(self.timeouts, ident)
            pipe.zrem(self.owners, ident)
            pipe.execute()
        return None

    def release(self, ident: str) -> bool:
        """Remove the holder from both sets; True if it was still in the timestamp set."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.zrem(self.timeouts, ident)
            pipe.zrem(self.owners, ident)
            removed = pipe.execute()[0]
        return bool(removed)


def acquire_lock_with_timeout(
    client: redis.Redis, name: str, acquire_timeout: float = 10.0, lock_timeout: float = 10.0
) -> str | None:
    """``SETNX`` lock with an expiry, retried every millisecond until ``acquire_timeout``."""
    ident = _new_id()
    key = f"{name}:lock"
    ttl = math.ceil(lock_timeout)
    deadline = time.time() + acquire_timeout
    while time.time() < deadline:
        if client.setnx(key, ident):
            client.expire(key, ttl)
            return ident
        if client.ttl(key) == -1:
            # The holder died between SETNX and EXPIRE: give the lock an expiry after all.
            client.expire(key, ttl)
        time.sleep(0.001)
    return None


def release_lock(client: redis.Redis, name: str, ident: str) -> bool:
    """Delete the lock only if ``ident`` still owns it (WATCH + MULTI, retried on conflict)."""
    key = f"{name}:lock"
    expected = ident.encode()
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)  # type: ignore[no-untyped-call]
                if pipe.get(key) != expected:
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.delete(key)
                pipe.execute()
                return True
            except redis.WatchError:
                continue


class LockedFairSemaphore(CounterFairSemaphore):
    """:class:`CounterFairSemaphore` whose acquisitions run under a short ``SETNX`` lock."""

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        limit: int,
        timeout: float = 10.0,
        lock_wait: float = 0.01,
    ) -> None:
        super().__init__(client, name, limit, timeout)
        self.lock_wait = lock_wait

    def acquire(self) -> str | None:
        """Take the lock (waiting at most ``lock_wait``), try the fair semaphore, drop the lock."""
        lock_id = acquire_lock_with_timeout(self.client, self.name, acquire_timeout=self.lock_wait)
        if lock_id is None:
            return None
        try:
            return super().acquire()
        finally:
            release_lock(self.client, self.name, lock_id)
