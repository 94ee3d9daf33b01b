"""Many processes against one semaphore: never over the limit, equal shares despite clock skew.

Each worker process counts holders independently of the semaphore (INCR right after a grant,
DECR right before the release) and reports the highest count it saw.
"""

from __future__ import annotations

import ast
import multiprocessing
import time
import uuid
from pathlib import Path
from typing import Any

import redis

import celery_redsem
from celery_redsem import FairSemaphore

LIMIT = 3


def _skew_clock(seconds: float) -> None:
    """Make this process's wall clock run ``seconds`` ahead (the semaphore must not care)."""
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + seconds  # type: ignore[assignment]
    time.time_ns = lambda: real_time_ns() + int(seconds * 1e9)  # type: ignore[assignment]


def _contend(
    url: str, prefix: str, skew: float, rounds: int, seconds: float, start: Any, out: Any
) -> None:
    if skew:
        _skew_clock(skew)
    client = redis.Redis.from_url(url)
    sem = FairSemaphore(client, "contended", LIMIT, prefix=prefix, lease=10)
    counter = f"{prefix}:independent-counter"
    client.ping()  # connected before the start: every process contends for the same window
    grants = highest = 0
    start.wait(60)
    deadline = time.monotonic() + seconds
    while grants < rounds and time.monotonic() < deadline:
        permit = sem.acquire(blocking=True, timeout=10)
        if permit is None:
            continue
        highest = max(highest, int(client.incr(counter)))
        client.decr(counter)
        sem.release(permit)
        grants += 1
    out.put((skew, grants, highest))


def _run(url: str, skews: list[float], rounds: int, seconds: float) -> list[tuple[float, int, int]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(len(skews) + 1)
    prefix = f"redsemtest-{uuid.uuid4().hex[:12]}"
    procs = [
        ctx.Process(target=_contend, args=(url, prefix, s, rounds, seconds, start, out))
        for s in skews
    ]
    for proc in procs:
        proc.start()
    start.wait(60)  # all set up: go
    return collect(procs, out, url, prefix)


def collect(procs: list[Any], out: Any, url: str, prefix: str) -> list[Any]:
    """Each process's result from ``out``; then check every process ended well, and delete the
    run's keys (under ``prefix``)."""
    results = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{prefix}:*"):
        client.delete(key)
    client.close()
    return results


def test_eight_processes_never_exceed_the_limit(redis_url):
    results = _run(redis_url, [0.0] * 8, rounds=300, seconds=60)
    assert sum(grants for _, grants, _ in results) == 8 * 300
    assert max(highest for _, _, highest in results) <= LIMIT
    assert max(highest for _, _, highest in results) >= 2  # the run really was concurrent


def test_clients_with_skewed_clocks_get_equal_shares(redis_url):
    # Half the processes believe it is 15 s later than it is, longer than a lease: by their
    # clocks every permit would have expired. Only the server clock counts. (Interleaved, so
    # that the order the processes start in does not favour either half.)
    results = _run(redis_url, [0.0, 15.0] * 4, rounds=10**9, seconds=2.0)
    skewed = sum(grants for skew, grants, _ in results if skew)
    total = sum(grants for _, grants, _ in results)
    assert total > 400
    assert 0.4 <= skewed / total <= 0.6
    assert max(highest for _, _, highest in results) <= LIMIT


_WALL_CLOCK = {
    "time": {"time", "time_ns", "localtime", "gmtime", "ctime", "asctime"},
    "datetime": {"now", "utcnow", "today", "datetime", "date"},
    "date": {"today"},
}


def test_the_package_never_reads_the_local_wall_clock():
    # The skew test above can pass only because nothing here looks at the local wall clock:
    # leases and order come from the server's TIME, waits from time.monotonic. Keep it so.
    found = []
    for path in sorted(Path(celery_redsem.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.attr in _WALL_CLOCK.get(node.value.id, ()):
                    found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in _WALL_CLOCK:
                names = {alias.name for alias in node.names} & _WALL_CLOCK[node.module]
                found += [f"{path.name}:{node.lineno} from {node.module} import {n}" for n in names]
    assert found == []
