"""Admission on every pool a Celery user runs: a burst on one key through a real ``celery
worker -P <pool>`` is parked in the worker (no trip through the broker), held to its limit,
and tasks of other keys sent after it are not held behind it. (Prefork: test_admission.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.integration.conftest import running_workers

#: The pools admission serves besides prefork, with the concurrency each is run at here.
POOLS = {"threads": 8, "gevent": 20, "eventlet": 20}


def _starts(app: Celery, key: str) -> list[str]:
    """The ``start <id>`` events of the bodies for ``key``, in order."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        entries = client.lrange(f"{app.conf.redsem_key_prefix}:t:log:{key}", 0, -1)
    finally:
        client.close()
    return [e.decode().split(" ", 1)[1] for e in entries if e.startswith(b"start ")]


@pytest.mark.slow
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_a_burst_is_parked_within_its_limit_and_other_keys_pass_it(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, pool: str
) -> None:
    # 60 tasks of 0.1 s on one key (limit 3: 2 s at the least) on a worker with more slots
    # than the limit, then one task on each of 4 other keys: the burst waits parked in the
    # worker, not in pool slots and not through the broker, and the others pass it.
    queue = f"pool-{pool}-{key}"
    with running_workers(
        redis_url, module_prefix, tmp_path, [pool], POOLS[pool], "-Q", queue, pool=pool
    ) as (worker,):
        burst = [app.tasks["t.counted"].apply_async((key, 0.1), queue=queue) for _ in range(60)]
        others = [
            app.tasks["t.counted"].apply_async((f"{key}-other{i}", 0.1), queue=queue)
            for i in range(4)
        ]
        assert all(result.get(timeout=30)["contention_retries"] == 0 for result in others)
        assert sum(not result.ready() for result in burst) >= 20  # passed, not waited behind
        outs = [result.get(timeout=90) for result in burst]
        # One process running more at once than kombu's 10 Redis connections: said at start.
        assert worker.log().count("kombu's max_connections") == (POOLS[pool] > 10)
    assert all(out["contention_retries"] == 0 and out["retries"] == 0 for out in outs)
    counter = redis.Redis.from_url(app.conf.broker_url)
    prefix = app.conf.redsem_key_prefix
    assert 1 <= int(counter.get(f"{prefix}:t:max:{key}") or 0) <= 3
    assert int(counter.get(f"{prefix}:t:cur:{key}") or 0) == 0
    counter.close()
    started = _starts(app, key)
    assert sorted(started) == sorted(r.id for r in burst)  # each ran once


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_worker_fetches_behind_a_burst_at_once_when_its_prefetch_window_frees(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, pool: str
) -> None:
    # A worker of 4 with a prefetch window of 4 messages (on the Redis broker) and a burst of
    # 60 short tasks on one key: the window fills with the burst, and frees as tasks start and
    # park. The consumer of a green worker polls the broker in a plain loop, and a poll (or
    # kombu's sleep) begun with the window full used to wait out its 1-2 s before fetching
    # again: stalls of 1.6-2 s, several a burst. It is woken when the window frees now.
    queue = f"window-{pool}-{key}"
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path,
        [pool],
        4,
        "-Q",
        queue,
        pool=pool,
        worker_prefetch_multiplier=1,
    ):
        burst = [app.tasks["t.counted"].apply_async((key, 0.02), queue=queue) for _ in range(60)]
        outs = [result.get(timeout=90) for result in burst]
    assert all(out["contention_retries"] == 0 for out in outs)
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        log = f"{app.conf.redsem_key_prefix}:t:log:{key}:at"
        starts = sorted(float(t) for t in client.lrange(log, 0, -1))
    finally:
        client.close()
    assert len(starts) == len(burst)
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert max(gaps) < 1.0, f"a start waited {max(gaps):.2f}s for the one before"
