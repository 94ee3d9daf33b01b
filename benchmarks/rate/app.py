"""The rate benchmark's Celery app: both variants of the task and the budget scenarios' tasks (a
cost per start, two windows), each start logged on the Redis server's clock. A worker builds its
own from the environment the benchmark gives it, in :func:`worker_app` (see
:mod:`benchmarks.rate.worker`); importing this module builds nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery

from benchmarks._brokers import isolated_app
from celery_redsem import contention_retries, with_rate_limit

#: The budget scenarios' limits: ``bench.cost`` takes ``units`` (its argument) of COST_RATE a
#: second with a burst of COST_BURST; ``bench.windows`` one start of each of WINDOWS (bursts
#: 1 and the minute's count).
COST_RATE, COST_BURST = 200.0, 20
WINDOWS = ["40/s", "300/m"]

ENV_URL, ENV_BROKER, ENV_PREFIX, ENV_RATE = (
    "REDSEM_BENCH_APP_URL",
    "REDSEM_BENCH_APP_BROKER",
    "REDSEM_BENCH_APP_PREFIX",
    "REDSEM_BENCH_APP_RATE",
)


def make_app(url: str, broker_url: str, prefix: str, rate: float) -> Celery:
    """The benchmark's app: both variants of the task; starts logged on the server's clock.

    Tasks go to the queue ``prefix`` (control messages to the exchange ``prefix``), so no other
    run sees them; results and records stay on the Redis server ``url`` under ``prefix``.
    """
    app = isolated_app("bench_rate", url, broker_url, prefix)
    clients: dict[int, redis.Redis] = {}

    def stamp(variant: str, key: str, n: int, request: Any) -> None:
        client = clients.setdefault(os.getpid(), redis.Redis.from_url(url))
        seconds, micros = client.time()
        trips = contention_retries(request)  # contention retries through the broker
        client.rpush(f"{prefix}:starts:{variant}:{key}", f"{seconds}.{micros:06d} {n} {trips}")

    @app.task(shared=False, bind=True, name="bench.ours", max_retries=0)
    @with_rate_limit(rate, key=lambda key: f"bench:{key}")
    def ours(self: Any, key: str, n: int) -> None:
        stamp("ours", key, n, self.request)

    @app.task(shared=False, bind=True, name="bench.cost", max_retries=0)
    @with_rate_limit(
        COST_RATE, key=lambda key: f"cost:{key}", burst=COST_BURST, cost=lambda units: units
    )
    def cost(self: Any, key: str, n: int, units: int) -> None:
        stamp("cost", key, n, self.request)

    @app.task(shared=False, bind=True, name="bench.windows", max_retries=0)
    @with_rate_limit(WINDOWS, key=lambda key: f"windows:{key}", max_wait=math.inf)
    def windows(self: Any, key: str, n: int) -> None:
        stamp("windows", key, n, self.request)

    @app.task(shared=False, bind=True, name="bench.celery", max_retries=0, rate_limit=f"{rate}/s")
    def celerys(self: Any, key: str, n: int) -> None:
        stamp("celery", key, n, self.request)

    return app


def worker_environ(url: str, broker_url: str, prefix: str, rate: float) -> dict[str, str]:
    """The environment variables that tell a worker how to build its app (:func:`worker_app`)."""
    return {ENV_URL: url, ENV_BROKER: broker_url, ENV_PREFIX: prefix, ENV_RATE: str(rate)}


def worker_app(environ: Mapping[str, str] | None = None) -> Celery:
    """A worker's app, built from ``environ`` (default: this process's environment) as
    :func:`worker_environ` wrote it (KeyError if a variable is missing)."""
    env = os.environ if environ is None else environ
    return make_app(env[ENV_URL], env[ENV_BROKER], env[ENV_PREFIX], float(env[ENV_RATE]))
