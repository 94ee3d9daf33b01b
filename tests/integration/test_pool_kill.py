"""A worker of the threads, gevent or eventlet pool SIGKILLed mid-burst: only the bodies it was
running are lost (acknowledged as they started, as Celery does by default; one whose ack had
not reached the broker runs once more); the tasks it had parked or sent to wait as standbys
run once on another worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from celery import Celery

from tests.integration.conftest import holder, running_workers
from tests.integration.test_backlog import _ids, _log, _most_at_once, _quick_redelivery
from tests.servers import wait_until


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
        wait_until(lambda: len(_ids(_log(app, key), "end")) >= 6, 30, what="the burst under way")
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        killed_at = len(_log(app, key))
        held_at_kill = {h.permit_id for h in holder(app, f"counted:{key}", 3).holders()}

        def settled() -> bool:
            events = _log(app, key)
            started, ended = set(_ids(events, "start")), set(_ids(events, "end"))
            return len((started - ended) | (ids - started)) <= 3 and (started | held_at_kill >= ids)

        wait_until(settled, 60, what="every task started, all but the dead ones ended")
        assert survivor.alive()
    events = _log(app, key)
    starts = _ids(events, "start")
    # A body the kill cut may run once more: its early ack (sent as the run began, after the
    # body could start) may not have reached the broker before the kill, and the broker then
    # delivers the message again (at-least-once; seen under a full CI run's load). Any other
    # task runs exactly once.
    before = events[:killed_at]
    cut = set(_ids(before, "start")) - set(_ids(before, "end"))
    again = {i for i in set(starts) if starts.count(i) > 1}
    assert again <= cut, "a task ran twice that the kill did not cut"
    assert all(starts.count(i) == 2 for i in again)
    assert ids - set(starts) <= held_at_kill, "a task never ran that the victim had not begun"
    assert _most_at_once(events, killed_at) <= 3
