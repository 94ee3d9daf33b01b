"""The fair-share benchmark's Celery app: the same task on a FIFO semaphore, on a grouped one
(``fair_by`` the account, ``weight`` an argument) and on a grouped one with a group limit, each
start logged on the Redis server's clock with an independent count of the runs at once. A worker
builds its own from the environment the benchmark gives it, in :func:`worker_app` (see
:mod:`benchmarks.fair.worker`); importing this module builds nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery

from benchmarks._brokers import isolated_app
from celery_redsem import contention_retries, with_semaphore

ENV_URL, ENV_BROKER, ENV_PREFIX, ENV_HOLD = (
    "REDSEM_BENCH_APP_URL",
    "REDSEM_BENCH_APP_BROKER",
    "REDSEM_BENCH_APP_PREFIX",
    "REDSEM_BENCH_APP_HOLD",
)
#: The shared limit, and the group limit of the capped variant.
LIMIT, GROUP_LIMIT = 4, 2

# Count a run in (over all accounts and for its own), keep the most at once, log its start.
_ENTER = """
for i = 1, 3, 2 do
  local c = redis.call('INCR', KEYS[i])
  if c > tonumber(redis.call('GET', KEYS[i + 1]) or '0') then redis.call('SET', KEYS[i + 1], c) end
end
local t = redis.call('TIME')
redis.call('RPUSH', KEYS[5], t[1] .. '.' .. string.format('%06d', t[2]) .. ' ' .. ARGV[1])
return 1
"""


def make_app(url: str, broker_url: str, prefix: str, hold: float) -> Celery:
    """The benchmark's app: the task on each kind of semaphore (bodies of ``hold`` seconds).

    Tasks go to the queue ``prefix`` (control messages to the exchange ``prefix``), so no other
    run sees them; results and records stay on the Redis server ``url`` under ``prefix``.
    """
    app = isolated_app("bench_fair", url, broker_url, prefix)
    clients: dict[int, redis.Redis] = {}

    def body(variant: str, account: str, request: Any) -> None:
        client = clients.setdefault(os.getpid(), redis.Redis.from_url(url))
        cur, top = f"{prefix}:cur:{variant}", f"{prefix}:max:{variant}"
        mine = [f"{cur}:{account}", f"{top}:{account}"]
        trips = contention_retries(request)  # contention retries through the broker
        client.eval(_ENTER, 5, cur, top, *mine, f"{prefix}:starts:{variant}", f"{account} {trips}")
        try:
            time.sleep(hold)
        finally:
            client.decr(cur)
            client.decr(mine[0])

    @app.task(shared=False, bind=True, name="bench.fifo")
    @with_semaphore(LIMIT, key="bench-fifo")
    def fifo(self: Any, account: str, weight: float) -> None:
        body("fifo", account, self.request)

    @app.task(shared=False, bind=True, name="bench.fair")
    @with_semaphore(
        LIMIT, key="bench-fair", fair_by=lambda account: account, weight=lambda weight: weight
    )
    def fair(self: Any, account: str, weight: float) -> None:
        body("fair", account, self.request)

    @app.task(shared=False, bind=True, name="bench.capped")
    @with_semaphore(
        LIMIT,
        key="bench-capped",
        fair_by=lambda account: account,
        weight=lambda weight: weight,
        group_limit=GROUP_LIMIT,
    )
    def capped(self: Any, account: str, weight: float) -> None:
        body("capped", account, self.request)

    return app


def worker_environ(url: str, broker_url: str, prefix: str, hold: float) -> dict[str, str]:
    """The environment variables that tell a worker how to build its app (:func:`worker_app`)."""
    return {ENV_URL: url, ENV_BROKER: broker_url, ENV_PREFIX: prefix, ENV_HOLD: str(hold)}


def worker_app(environ: Mapping[str, str] | None = None) -> Celery:
    """A worker's app, built from ``environ`` (default: this process's environment) as
    :func:`worker_environ` wrote it (KeyError if a variable is missing)."""
    env = os.environ if environ is None else environ
    return make_app(env[ENV_URL], env[ENV_BROKER], env[ENV_PREFIX], float(env[ENV_HOLD]))
