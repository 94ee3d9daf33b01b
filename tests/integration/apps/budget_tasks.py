"""Rate-limited test tasks with budgets, added to a test app by :func:`add_budget_tasks`: a
cost per start (``r.spend``), two windows (``r.windows``), units charged by the body after
the fact (``r.charge``), and a body that pauses its key (``r.call``, as after an HTTP 429);
and semaphore-guarded ones: ``r.sem_call`` (a body that pauses its semaphore's key) and
``r.sem_free`` (a semaphore never full, with ``on_busy="fail"``), ``r.sem_wait`` (never full,
waiting its turn: admission parks its runs).
Each start is logged as the ``r.*`` tasks log theirs (:mod:`tests.integration.apps.rate_tasks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_redsem import current_rate_limiter, pause_and_retry, with_rate_limit, with_semaphore

#: r.spend: units per second and units at once; each run's cost is its ``units`` argument.
SPEND_RATE, SPEND_BURST = 100.0, 20
#: r.windows: ten starts a second and four a minute; a run may wait two seconds at most.
WINDOWS, WINDOWS_MAX_WAIT = ["10/s", "4/m"], 2.0
#: r.charge: ten units a second, one at once; each start takes one unit, the body charges more.
CHARGE_RATE = 10.0
#: r.call: twenty starts a second; run 0's first call pauses the key this long, once a key
#: (the server time, microseconds, just before it paused is kept in ``<prefix>:r:429:<key>``).
CALL_RATE, CALL_PAUSE = 20.0, 1.5
#: r.sem_call: one run at a time; run 0's first call pauses the key this long, once a key
#: (the server time, as for r.call, in ``<prefix>:r:sem429:<key>``).
SEM_PAUSE = 1.5

LogStart = Callable[[str, int, Any], None]


def add_budget_tasks(
    app: Celery, log_start: LogStart, client: Callable[[], redis.Redis], prefix: str
) -> None:
    """Register ``r.spend``, ``r.windows``, ``r.charge``, ``r.call`` and the ``r.sem_*`` tasks
    on ``app``."""

    @app.task(shared=False, bind=True, name="r.spend", max_retries=0)
    @with_rate_limit(
        SPEND_RATE, key=lambda key: f"spend:{key}", burst=SPEND_BURST, cost=lambda units: units
    )
    def spend(self: Any, key: str, n: int = 0, units: int = 1) -> int:
        log_start(key, n, self.request)
        return n

    @app.task(shared=False, bind=True, name="r.windows", max_retries=0)
    @with_rate_limit(WINDOWS, key=lambda key: f"win:{key}", max_wait=WINDOWS_MAX_WAIT)
    def windows(self: Any, key: str, n: int = 0) -> int:
        log_start(key, n, self.request)
        return n

    @app.task(shared=False, bind=True, name="r.charge", max_retries=0)
    @with_rate_limit(CHARGE_RATE, key=lambda key: f"charge:{key}")
    def charge(self: Any, key: str, n: int = 0, units: int = 0) -> int:
        log_start(key, n, self.request)
        limiter = current_rate_limiter()
        assert limiter is not None
        if units:
            limiter.charge(units)
        return n

    @app.task(shared=False, bind=True, name="r.call", max_retries=0)
    @with_rate_limit(CALL_RATE, key=lambda key: f"call:{key}")
    def call(self: Any, key: str, n: int = 0) -> int:
        log_start(key, n, self.request)
        seconds, micros = client().time()
        if n == 0 and client().set(f"{prefix}:r:429:{key}", seconds * 1_000_000 + micros, nx=True):
            pause_and_retry(CALL_PAUSE)  # "429 Too Many Requests", "Retry-After: 1.5"
        return n

    @app.task(shared=False, bind=True, name="r.sem_call", max_retries=0)
    @with_semaphore(1, key=lambda key: f"scall:{key}")
    def sem_call(self: Any, key: str, n: int = 0) -> int:
        log_start(key, n, self.request)
        seconds, micros = client().time()
        marker = f"{prefix}:r:sem429:{key}"
        if n == 0 and client().set(marker, seconds * 1_000_000 + micros, nx=True):
            pause_and_retry(SEM_PAUSE)  # "429 Too Many Requests", "Retry-After: 1.5"
        return n

    @app.task(shared=False, bind=True, name="r.sem_free", max_retries=0)
    @with_semaphore(100, key=lambda key: f"sfree:{key}", on_busy="fail", max_wait=1)
    def sem_free(self: Any, key: str, n: int = 0) -> int:
        log_start(key, n, self.request)
        return n

    @app.task(shared=False, bind=True, name="r.sem_wait", max_retries=0)
    @with_semaphore(100, key=lambda key: f"swait:{key}")
    def sem_wait(self: Any, key: str, n: int = 0) -> int:
        log_start(key, n, self.request)
        return n
