"""The heartbeat among greenlets: a body that computes without yielding for longer than its
lease keeps its permit (the heartbeat runs in OS threads), and the ``raise`` policy interrupts
a greenlet body at its next yield."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redsem import PermitLost
from tests.integration.conftest import holder, running_workers
from tests.servers import wait_until


def _pid_noted(app: Celery, key: str) -> None:
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        prefix = app.conf.redsem_key_prefix
        wait_until(lambda: client.get(f"{prefix}:t:pid:{key}"), 30, what="the body started")
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_greenlet_computing_without_yield_keeps_its_permit(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, pool: str
) -> None:
    # A body computes for 5 s without yielding under a 2 s lease: the heartbeat, an OS thread,
    # keeps renewing its permit, so nobody else gets it meanwhile.
    queue = f"spin-{pool}-{key}"
    with running_workers(redis_url, module_prefix, tmp_path, [pool], 4, "-Q", queue, pool=pool):
        result = app.tasks["t.spin"].apply_async((key, 5.0), queue=queue)
        _pid_noted(app, key)
        sem = holder(app, f"spin:{key}", lease=2.0)
        tries = 0
        while not result.ready():
            assert sem.acquire(blocking=False) is None, "the spinning body's permit was taken"
            tries += 1
            time.sleep(0.2)
        out = result.get(timeout=10)
    assert tries >= 15  # (asked throughout the 5 s)
    assert out["lost"] is False
    assert out["steps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_the_raise_policy_interrupts_a_greenlet_at_its_next_yield(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, pool: str
) -> None:
    queue = f"raise-{pool}-{key}"
    with running_workers(redis_url, module_prefix, tmp_path, [pool], 4, "-Q", queue, pool=pool):
        result = app.tasks["t.lost_raises"].apply_async((key,), queue=queue)
        _pid_noted(app, key)
        assert holder(app, f"lost:{key}").release(result.id)  # an operator takes it away
        taken = time.monotonic()
        with pytest.raises(PermitLost, match="lost its lease"):
            result.get(timeout=15)
        assert time.monotonic() - taken < 5  # interrupted, not run to its end (30 s)
