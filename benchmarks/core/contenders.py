"""The implementations the core benchmark measures, behind one protocol (:class:`Contender`),
and the report's rows (:data:`IMPLS`): two floors, celery_redsem's FairSemaphore (waiting in its
line, and driven like the seeds), redis-py's ``Lock`` and the three "Redis in Action" semaphores
of :mod:`benchmarks.core.seed_semaphores`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from benchmarks.core.seed_semaphores import (
    BasicSemaphore,
    CounterFairSemaphore,
    LockedFairSemaphore,
)
from celery_redsem import FairSemaphore

TRIVIAL_SCRIPT = "return 1"


class Contender(Protocol):
    """What the benchmark needs from an implementation: try once, give back."""

    def try_acquire(self) -> object | None:
        """One non-blocking attempt: a handle for :meth:`release`, or None."""

    def acquire_within(self, seconds: float) -> object | None:
        """The implementation's natural way to get a permit within ``seconds`` (or None)."""

    def release(self, handle: Any) -> None:
        """Give back what :meth:`try_acquire` returned."""


class TryOnly:
    """Mixin: an implementation without a waiting mode tries once."""

    def try_acquire(self) -> object | None:
        raise NotImplementedError

    def acquire_within(self, seconds: float) -> object | None:
        return self.try_acquire()


class Floor(TryOnly):
    """Two bare ``EVALSHA`` round trips of a trivial script: the cost floor of a pair."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.client = client
        self.sha = str(client.script_load(TRIVIAL_SCRIPT))

    def try_acquire(self) -> object | None:
        reply: object = self.client.evalsha(self.sha, 0)
        return reply

    def release(self, handle: Any) -> None:
        self.client.evalsha(self.sha, 0)


class HeldFloor(Floor):
    """The floor's two ``EVALSHA`` calls over one kept connection (a single-connection client),
    the transport FairSemaphore's acquire and release use (celery_redsem/lane.py): the floor
    without the pool checkout that every plain client call pays."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        super().__init__(client, prefix, limit)
        self.client = redis.Redis(
            connection_pool=client.connection_pool, single_connection_client=True
        )


class Redsem:
    """celery_redsem's FairSemaphore; ``acquire_within`` waits in the FIFO line."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = FairSemaphore(client, "bench", limit, prefix=prefix)

    def try_acquire(self) -> object | None:
        return self.sem.acquire()

    def acquire_within(self, seconds: float) -> object | None:
        return self.sem.acquire(blocking=True, timeout=seconds)

    def release(self, handle: Any) -> None:
        self.sem.release(handle)


class RedsemTry(Redsem):
    """FairSemaphore driven like the seeds: try once, back off, try again."""

    def acquire_within(self, seconds: float) -> object | None:
        return self.try_acquire()


class RedisPyLock(TryOnly):
    """``redis.lock.Lock`` (always a limit of 1)."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.lock = client.lock(f"{prefix}:redis-py-lock", timeout=10)

    def try_acquire(self) -> object | None:
        return True if self.lock.acquire(blocking=False) else None

    def release(self, handle: Any) -> None:
        self.lock.release()


class _Seed(TryOnly):
    """Adapter for the seed semaphores (acquire returns an id or None)."""

    sem: BasicSemaphore | CounterFairSemaphore

    def try_acquire(self) -> object | None:
        return self.sem.acquire()

    def release(self, handle: Any) -> None:
        self.sem.release(handle)


class SeedBasic(_Seed):
    """Seed 1: sorted set scored by client timestamps."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = BasicSemaphore(client, f"{prefix}:seed-basic", limit)


class SeedFair(_Seed):
    """Seed 2: counter + owner set, two pipelines."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = CounterFairSemaphore(client, f"{prefix}:seed-fair", limit)


class SeedLockedFair(_Seed):
    """Seed 3: seed 2 under a SETNX lock with a 10 ms acquire timeout."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = LockedFairSemaphore(client, f"{prefix}:seed-locked", limit)


Factory = Callable[[redis.Redis, str, int], Contender]


@dataclass(frozen=True)
class Impl:
    """One row of the report."""

    key: str
    label: str
    factory: Factory
    idle_key: str | None = None  # reuse another row's idle numbers
    lock_only: bool = False  # contention with limit 1
    contend: bool = True


IMPLS: list[Impl] = [
    Impl("floor", "floor: 2x EVALSHA 'return 1'", Floor, contend=False),
    Impl("held-floor", "  same, on a kept connection", HeldFloor, contend=False),
    Impl("redsem", "FairSemaphore, FIFO wait", Redsem),
    Impl("redsem-try", "FairSemaphore, try+backoff", RedsemTry, idle_key="redsem"),
    Impl("redis-lock", "redis-py Lock (limit 1)", RedisPyLock, lock_only=True),
    Impl("seed-basic", "seed: basic zset", SeedBasic),
    Impl("seed-fair", "seed: fair (counter)", SeedFair),
    Impl("seed-locked", "seed: fair + SETNX lock", SeedLockedFair),
]
BY_KEY = {impl.key: impl for impl in IMPLS}
