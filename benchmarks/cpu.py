"""CPU time a benchmark batch cost, per task, by process: read from ``/proc`` (Linux).

A guarded batch's throughput against a plain one's moves by a few percent from run to run on a
shared host; the CPU each batch costs moves far less, and says where a guarded task's extra cost
is: in the workers' main processes (admission), in their pool children (the guard around the
body), or in the Redis server (the scripts). :class:`CpuMeter` reads the CPU seconds (user and
system) of the workers' main processes, of their children alive at that moment, and of the
Redis servers on this host; :func:`per_task` turns two readings into milliseconds per task.
Where there is no ``/proc`` (not Linux), readings are None and nothing is printed.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis

__all__ = [
    "CpuMeter",
    "CpuReading",
    "compare_line",
    "cpu_seconds",
    "local_redis_pid",
    "median_reading",
    "per_task",
]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class CpuReading:
    """CPU seconds (or, from :func:`per_task`, milliseconds per task) by kind of process."""

    main: float  # the workers' main processes
    children: float  # their pool children
    redis: float  # the Redis servers on this host (the broker too, when it is one of them)

    @property
    def total(self) -> float:
        return self.main + self.children + self.redis

    def __sub__(self, other: CpuReading) -> CpuReading:
        return CpuReading(
            self.main - other.main, self.children - other.children, self.redis - other.redis
        )


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rpartition(")")[2].split()  # (the name, in parentheses, may hold spaces)


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` so far (None: gone, or no ``/proc``)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (stat fields 14, 15)


def children_of(pids: Iterable[int]) -> list[int]:
    """The live processes whose parent is one of ``pids``."""
    parents = set(pids)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and int(fields[1]) in parents:  # ppid (stat field 4)
                found.append(int(entry))
    return found


def local_redis_pid(url: str) -> int | None:
    """The process id of the Redis server at ``url`` if it runs on this host, else None."""
    host = urlsplit(url).hostname
    if host is not None and host not in _LOCAL_HOSTS:
        return None
    client = redis.Redis.from_url(url)
    try:
        pid = client.info("server").get("process_id")
    except redis.RedisError:
        return None
    finally:
        client.close()
    return int(pid) if pid is not None and cpu_seconds(int(pid)) is not None else None


class CpuMeter:
    """Reads the CPU seconds of a run's workers (main processes and pool children) and of its
    local Redis servers; ``read()`` is None where ``/proc`` cannot be read."""

    def __init__(self, worker_pids: Iterable[int], redis_pids: Iterable[int | None]) -> None:
        self._workers = list(worker_pids)
        self._servers = sorted({pid for pid in redis_pids if pid is not None})

    def read(self) -> CpuReading | None:
        main = [cpu_seconds(pid) for pid in self._workers]
        if not os.path.isdir("/proc") or any(cpu is None for cpu in main):
            return None
        children = [cpu_seconds(pid) for pid in children_of(self._workers)]
        servers = [cpu_seconds(pid) for pid in self._servers]
        return CpuReading(
            sum(c for c in main if c is not None),
            sum(c for c in children if c is not None),
            sum(c for c in servers if c is not None),
        )


def per_task(before: CpuReading | None, after: CpuReading | None, tasks: int) -> CpuReading | None:
    """Milliseconds of CPU per task between two readings (None if either is missing)."""
    if before is None or after is None or tasks <= 0:
        return None
    spent = after - before
    return CpuReading(
        spent.main * 1000 / tasks, spent.children * 1000 / tasks, spent.redis * 1000 / tasks
    )


def median_reading(readings: Iterable[CpuReading | None]) -> CpuReading | None:
    """The median of each kind over ``readings`` (None if any is missing, or there are none)."""
    values = list(readings)
    if not values or any(r is None for r in values):
        return None
    kept = [r for r in values if r is not None]
    return CpuReading(
        statistics.median(r.main for r in kept),
        statistics.median(r.children for r in kept),
        statistics.median(r.redis for r in kept),
    )


def compare_line(
    guarded: Iterable[CpuReading | None], plain: Iterable[CpuReading | None]
) -> str | None:
    """One line: the median CPU milliseconds per task of the guarded and the plain batches,
    by process, and the difference (None where it was not measured)."""
    g, p = median_reading(guarded), median_reading(plain)
    if g is None or p is None:
        return None

    def cells(r: CpuReading, sign: str = "") -> str:
        return (
            f"main {r.main:{sign}.2f}, children {r.children:{sign}.2f}, "
            f"Redis {r.redis:{sign}.2f} (all {r.total:{sign}.2f})"
        )

    return (
        f"CPU ms per task (median of the rounds): guarded {cells(g)}; plain {cells(p)}; "
        f"guarded - plain {cells(g - p, '+')}"
    )
