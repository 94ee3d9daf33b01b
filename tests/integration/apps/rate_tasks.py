"""Rate-limited test tasks, added to a test app by :func:`add_rate_tasks`.

Each start is logged on the server's clock in ``<prefix>:r:starts:<key>``, one entry per run:
``"<microseconds> <n> <retries> <trips> <worker>"`` (the run's number, its own
``request.retries``, its contention retries through the broker from the ``redsem_wait`` header,
and the node name of the worker that ran it). The stacked tasks
also count themselves in and out (``<prefix>:t:cur:<key>``, most at once in ``<prefix>:t:max:
<key>``), as the semaphore tests do.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import redis
from celery import Celery

from celery_redsem import contention_retries, with_rate_limit, with_semaphore
from tests.integration.apps.budget_tasks import add_budget_tasks
from tests.integration.apps.tasks import _ENTER, _EXIT, app_settings, make_app

#: The stacked tasks: a semaphore of STACK_LIMIT and a rate of STACK_RATE a second with a burst
#: of STACK_BURST (above the limit, so only the semaphore keeps a burst's runs apart), each body
#: lasting STACK_BODY seconds (the semaphore alone would start runs faster than the rate).
STACK_LIMIT, STACK_RATE, STACK_BURST, STACK_BODY = 2, 5.0, 4, 0.15


class Start(NamedTuple):
    """One logged start."""

    at: float  # server time, seconds
    n: int
    retries: int  # the run's own request.retries
    trips: int  # contention retries through the broker
    worker: str  # the node name of the worker that ran it


def read_starts(client: redis.Redis, prefix: str, key: str) -> list[Start]:
    """The starts logged for ``key``, in time order."""
    rows = []
    for raw in client.lrange(f"{prefix}:r:starts:{key}", 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else raw
        micros, n, retries, trips, worker = text.split()
        rows.append(Start(int(micros) / 1e6, int(n), int(retries), int(trips), worker))
    return sorted(rows)


def make_rate_app(redis_url: str, prefix: str) -> Celery:
    """The test app (:func:`~tests.integration.apps.tasks.make_app`) with every ``r.*`` task."""
    app = make_app(redis_url, prefix)
    add_rate_tasks(app, redis_url, prefix)
    return app


def make_rate_only_app(redis_url: str, prefix: str) -> Celery:
    """An app whose only guarded task is ``r.tick`` (no semaphore anywhere), set up as
    :func:`~tests.integration.apps.tasks.make_app` sets up its apps."""
    app = Celery("redsemtest-rate", set_as_current=False)
    app.conf.update(app_settings(redis_url, prefix))
    add_rate_tasks(app, redis_url, prefix, stacked=False)
    return app


def add_rate_tasks(app: Celery, redis_url: str, prefix: str, *, stacked: bool = True) -> None:
    """Register the ``r.*`` tasks on ``app`` (``r.tick`` alone unless ``stacked``)."""
    clients: dict[int, redis.Redis] = {}

    def counter() -> redis.Redis:
        if os.getpid() not in clients:
            clients[os.getpid()] = redis.Redis.from_url(redis_url)
        return clients[os.getpid()]

    def log_start(key: str, n: int, request: Any) -> None:
        client = counter()
        seconds, micros = client.time()
        trips = contention_retries(request)
        entry = f"{seconds * 1_000_000 + micros} {n} {request.retries} {trips} {request.hostname}"
        client.rpush(f"{prefix}:r:starts:{key}", entry)

    def counted(key: str, n: int, request: Any) -> None:
        log = f"{prefix}:t:log:{key}"
        keys = [f"{prefix}:t:cur:{key}", f"{prefix}:t:max:{key}", log, f"{log}:at"]
        counter().eval(_ENTER, 4, *keys, request.id)
        try:
            log_start(key, n, request)
            time.sleep(STACK_BODY)
        finally:
            counter().eval(_EXIT, 3, *keys[:3], request.id)

    @app.task(shared=False, bind=True, name="r.tick", max_retries=0)
    @with_rate_limit("20/s", key=lambda key: f"rate:{key}")
    def tick(self: Any, key: str, n: int = 0) -> int:
        log_start(key, n, self.request)
        return n

    if stacked:
        add_stacked_tasks(app, counted)
        add_budget_tasks(app, log_start, counter, prefix)


def add_stacked_tasks(app: Celery, counted: Any) -> None:
    """The ``r.*`` tasks with both a rate limit and a semaphore, in both orders."""

    @app.task(shared=False, bind=True, name="r.rate_over_sem", max_retries=0)
    @with_rate_limit(STACK_RATE, key=lambda key: f"rs:{key}", burst=STACK_BURST)
    @with_semaphore(limit=STACK_LIMIT, key=lambda key: f"rs:{key}")
    def rate_over_sem(self: Any, key: str, n: int = 0) -> int:
        counted(key, n, self.request)
        return n

    @app.task(shared=False, bind=True, name="r.sem_over_rate", max_retries=0)
    @with_semaphore(limit=STACK_LIMIT, key=lambda key: f"sr:{key}")
    @with_rate_limit(STACK_RATE, key=lambda key: f"sr:{key}", burst=STACK_BURST)
    def sem_over_rate(self: Any, key: str, n: int = 0) -> int:
        counted(key, n, self.request)
        return n
