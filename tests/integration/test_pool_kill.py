"""A worker of the threads, gevent or eventlet pool SIGKILLed mid-burst: only the bodies it was
running are lost (acknowledged as they started, as Celery does by default); the tasks it had
parked or sent to wait as standbys run once on another worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from tests.integration.conftest import running_workers
from tests.integration.test_backlog import (
    _ids,
    _kill_mid_burst,
    _log,
    _most_at_once,
    _quick_redelivery,
)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_a_killed_worker_loses_only_the_bodies_it_ran(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, pool: str
) -> None:
    # 30 tasks of 0.1 s on one key (limit 3) through two workers; one is SIGKILLed mid-burst.
    # Its running bodies are lost with it (acknowledged as they started, as Celery does by
    # default); the tasks it had parked were never acknowledged, and run once on the other.
    queue = f"kill-{pool}-{key}"
    conf = {"broker_transport_options": _quick_redelivery(module_prefix)}
    with running_workers(
        redis_url, module_prefix, tmp_path, [f"{pool}-v", f"{pool}-s"], 8, "-Q", queue,
        pool=pool, **conf,
    ) as (victim, survivor):  # fmt: skip
        sent = [app.tasks["t.counted"].apply_async((key, 0.1), queue=queue) for _ in range(30)]
        ids = {r.id for r in sent}
        killed_at, held_at_kill = _kill_mid_burst(app, key, ids, victim, survivor, 3)
    events = _log(app, key)
    starts = _ids(events, "start")
    assert len(starts) == len(set(starts)), "a task ran twice"
    assert ids - set(starts) <= held_at_kill, "a task never ran that the victim had not begun"
    assert _most_at_once(events, killed_at) <= 3
