"""A worker of the threads, gevent or eventlet pool stopped mid-burst by a warm shutdown
(SIGTERM): every task runs once, the parked ones on the next worker (test_pool_kill: SIGKILL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from tests.integration.conftest import running_workers
from tests.integration.test_backlog import _ids, _log, _most_at_once, _quick_redelivery
from tests.servers import wait_until


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_a_warm_shutdown_mid_burst_runs_every_task_once(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, pool: str
) -> None:
    # 30 tasks of 0.1 s on one key (limit 3); the worker gets SIGTERM after a few: it finishes
    # the bodies it runs, and the tasks it had parked (unacknowledged) go back to the broker,
    # for the next worker. Each task starts once, never more than 3 at once.
    queue = f"term-{pool}-{key}"
    conf = {"broker_transport_options": _quick_redelivery(module_prefix)}
    with running_workers(
        redis_url, module_prefix, tmp_path, [f"{pool}-a"], 8, "-Q", queue, pool=pool, **conf
    ) as (first,):
        sent = [app.tasks["t.counted"].apply_async((key, 0.1), queue=queue) for _ in range(30)]
        wait_until(lambda: len(_ids(_log(app, key), "end")) >= 6, 30, what="the burst under way")
        first.begin_stop()
        first.proc.wait(30)
    with running_workers(
        redis_url, module_prefix, tmp_path, [f"{pool}-b"], 8, "-Q", queue, pool=pool, **conf
    ):
        assert all(r.get(timeout=60)["name"] == f"counted:{key}" for r in sent)
    events = _log(app, key)
    starts = _ids(events, "start")
    assert sorted(starts) == sorted(r.id for r in sent), "a task ran twice, or never"
    assert _most_at_once(events, len(events)) <= 3
