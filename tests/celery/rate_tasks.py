"""Rate-limited test tasks, added to a test app by :func:`add_rate_tasks`.

Each start is logged with the server's clock in ``<prefix>:r:starts:<key>`` (a list of
microseconds), and each run's contention retries in ``<prefix>:r:retries:<key>``.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery

from celery_redsem import read_state, with_rate_limit, with_semaphore
from celery_redsem.integration.waiting import WAIT_HEADER


def add_rate_tasks(app: Celery, redis_url: str, prefix: str) -> None:
    """Register the ``r.*`` tasks on ``app``."""
    clients: dict[int, redis.Redis] = {}

    def counter() -> redis.Redis:
        if os.getpid() not in clients:
            clients[os.getpid()] = redis.Redis.from_url(redis_url)
        return clients[os.getpid()]

    def log_start(key: str, request: Any) -> int:
        client = counter()
        seconds, micros = client.time()
        wait = (request.headers or {}).get(WAIT_HEADER) or [0]
        client.rpush(f"{prefix}:r:starts:{key}", seconds * 1_000_000 + micros)
        client.rpush(f"{prefix}:r:retries:{key}", request.retries)
        return int(wait[0])

    @app.task(shared=False, bind=True, name="r.tick", max_retries=0)
    @with_rate_limit("20/s", key=lambda key: f"rate:{key}")
    def tick(self: Any, key: str, n: int = 0) -> int:
        log_start(key, self.request)
        return n

    @app.task(shared=False, bind=True, name="r.rate_then_lock", max_retries=0)
    @with_rate_limit("20/s", key=lambda key: f"rl:{key}")
    @with_semaphore(limit=1, key=lambda key: f"rl:{key}")
    def rate_then_lock(self: Any, key: str) -> list[str]:
        log_start(key, self.request)
        return [h.permit_id for h in read_state(counter(), f"rl:{key}", prefix=prefix).holders]

    @app.task(shared=False, bind=True, name="r.lock_then_rate", max_retries=0)
    @with_semaphore(limit=2, key=lambda key: f"lr:{key}")
    @with_rate_limit(10, key=lambda key: f"lr:{key}", burst=2)
    def lock_then_rate(self: Any, key: str) -> int:
        log_start(key, self.request)
        return 1
