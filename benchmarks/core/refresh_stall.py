"""How long one refresh script call can stall the server: the core benchmark's "worst refresh
call" measurement (issue 20, item 10).

A process holding ``N`` permits refreshes them all at once. A script blocks every other client
of its server while it runs, so what matters is the longest single call, read from the
server's own ``SLOWLOG`` (every command logged, ``slowlog-log-slower-than 0``; the settings
are put back afterwards). Measured twice on the same permits: all in one script call (as before
chunking) and in calls of at most :data:`~celery_redsem.core.refresh.REFRESH_CHUNK`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from celery_redsem import FairSemaphore, Permit, refresh_permits
from celery_redsem.core import refresh
from celery_redsem.core.scripts import REFRESH

__all__ = ["StallResult", "print_stall", "run_refresh_stall"]

PER_SEMAPHORE = 1000
REPEATS = 3


@dataclass(frozen=True)
class StallResult:
    """One way of refreshing: script calls per refresh, worst and median call (server µs),
    and the whole refresh's wall time (ms, median)."""

    label: str
    calls: int
    worst_us: int
    median_us: float
    wall_ms: float


@contextmanager
def _chunk(size: int) -> Iterator[None]:
    before = refresh.REFRESH_CHUNK
    refresh.REFRESH_CHUNK = size
    try:
        yield
    finally:
        refresh.REFRESH_CHUNK = before


@contextmanager
def _log_every_command(client: redis.Redis, entries: int) -> Iterator[None]:
    saved = {k: client.config_get(k)[k] for k in ("slowlog-log-slower-than", "slowlog-max-len")}
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", entries)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is not None:
                client.config_set(key, value)


def _measure(client: redis.Redis, permits: list[Permit], label: str) -> StallResult:
    durations: list[int] = []
    walls: list[float] = []
    calls = 0
    sha = REFRESH.sha.encode()
    for _ in range(REPEATS):
        client.slowlog_reset()
        started = time.perf_counter()
        result = refresh_permits(client, permits)
        walls.append((time.perf_counter() - started) * 1000)
        assert len(result.refreshed) == len(permits), "a permit was lost while measuring"
        mine = [
            int(e["duration"])
            for e in client.slowlog_get(100_000)
            if e["command"].startswith(b"EVALSHA " + sha)
        ]
        calls = len(mine)
        durations += mine
    return StallResult(
        label, calls, max(durations), statistics.median(durations), statistics.median(walls)
    )


def run_refresh_stall(client: redis.Redis, prefix: str, count: int) -> list[StallResult]:
    """Hold ``count`` permits, then time refreshing them in one call and in chunks."""
    sems = [
        FairSemaphore(client, f"stall{i}", PER_SEMAPHORE, lease=300, prefix=prefix)
        for i in range(-(-count // PER_SEMAPHORE))
    ]
    permits = []
    for i in range(count):
        permit = sems[i // PER_SEMAPHORE].acquire()
        assert isinstance(permit, Permit)
        permits.append(permit)
    refresh_permits(client, permits[:1])  # the script is loaded before anything is timed
    with _log_every_command(client, 100_000):
        with _chunk(count):
            whole = _measure(client, permits, "one call (before)")
        chunked = _measure(client, permits, f"chunks of {refresh.REFRESH_CHUNK}")
    for sem in sems:
        for holder in sem.holders():
            sem.release(holder.permit_id)
    return [whole, chunked]


def print_stall(results: list[StallResult], count: int) -> None:
    """The table: one row per way of refreshing."""
    print(f"\nRefreshing {count} permits ({REPEATS} times each; server time from SLOWLOG):")
    print(f"  {'':20} {'calls':>6} {'worst call':>12} {'median call':>12} {'whole refresh':>14}")
    for r in results:
        print(
            f"  {r.label:20} {r.calls:>6} {r.worst_us / 1000:>9.2f} ms "
            f"{r.median_us / 1000:>9.2f} ms {r.wall_ms:>11.1f} ms"
        )
