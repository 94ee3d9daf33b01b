"""Many processes against one grouped semaphore: never over the limit nor a group's limit, and
the grants shared by weight while every group waits.

Each worker process counts holders independently of the semaphore (INCR of a total and of its
group's counter right after a grant, DECR right before the release) and reports the highest
counts it saw.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections import Counter
from typing import Any

import redis

from celery_redsem import FairSemaphore
from tests.test_contention import collect

WORKERS = {"a": 2.0, "b": 1.0, "c": 1.0}  # group -> weight; three processes a group


def _contend(
    url: str, prefix: str, limit: int, group_limit: int | None, group: str, seconds: float,
    start: Any, out: Any,
) -> None:  # fmt: skip
    client = redis.Redis.from_url(url)
    sem = FairSemaphore(
        client, "contended", limit, prefix=prefix, lease=10, grouped=True, group_limit=group_limit
    )
    total, mine = f"{prefix}:count", f"{prefix}:count:{group}"
    client.ping()
    grants = highest = highest_group = 0
    start.wait(60)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        permit = sem.acquire(blocking=True, timeout=10, group=group, weight=WORKERS[group])
        if permit is None:
            continue
        highest = max(highest, int(client.incr(total)))
        highest_group = max(highest_group, int(client.incr(mine)))
        client.decr(mine)
        client.decr(total)
        sem.release(permit)
        grants += 1
    out.put((group, grants, highest, highest_group))


def _run(
    url: str, limit: int, group_limit: int | None, seconds: float
) -> list[tuple[str, int, int, int]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    groups = [g for g in WORKERS for _ in range(3)]
    start = ctx.Barrier(len(groups) + 1)
    prefix = f"redsemtest-{uuid.uuid4().hex[:12]}"
    procs = [
        ctx.Process(target=_contend, args=(url, prefix, limit, group_limit, g, seconds, start, out))
        for g in groups
    ]
    for proc in procs:
        proc.start()
    start.wait(60)
    return collect(procs, out, url, prefix)


def test_nine_processes_in_three_groups_never_exceed_either_limit(redis_url):
    results = _run(redis_url, limit=4, group_limit=2, seconds=4)
    assert max(r[2] for r in results) <= 4
    assert max(r[3] for r in results) <= 2
    assert max(r[3] for r in results) == 2  # the group limit was reached, not merely respected
    assert all(r[1] > 0 for r in results)  # no process starved


def test_with_every_group_waiting_grants_follow_the_weights(redis_url):
    results = _run(redis_url, limit=1, group_limit=None, seconds=4)
    grants: Counter[str] = Counter()
    for group, n, highest, _ in results:
        grants[group] += n
        assert highest <= 1
    total = sum(grants.values())
    assert total >= 200
    for group, weight in WORKERS.items():  # three processes a group: each group always waits
        assert abs(grants[group] / total - weight / sum(WORKERS.values())) <= 0.05, grants
