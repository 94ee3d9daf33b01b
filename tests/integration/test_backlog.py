"""A deep line on one key through real prefork workers: parked in the workers, not cycled
through the broker, and nothing lost or run twice when a worker is killed in the middle of it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_redsem.ops.cli import redsem
from tests.integration.conftest import holder, running_workers
from tests.servers import wait_until


def _log(app: Celery, key: str) -> list[str]:
    """The ``start <id>`` / ``end <id>`` events of the bodies for ``key``, in order."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        entries = client.lrange(f"{app.conf.redsem_key_prefix}:t:log:{key}", 0, -1)
    finally:
        client.close()
    return [entry.decode() for entry in entries]


def _most_at_once(events: list[str], killed_at: int) -> int:
    """The most bodies running at once, counting a body the kill cut (started before
    ``killed_at``, where the dead worker's events stop, and never ended, or started again
    after it: delivered once more) as ended at ``killed_at``."""
    before, after = events[:killed_at], events[killed_at:]
    ended_before, ended = set(_ids(before, "end")), set(_ids(events, "end"))
    again = set(_ids(after, "start"))
    dead = {
        i for i in _ids(before, "start") if i not in ended_before and (i not in ended or i in again)
    }
    ordered = [*before, *(f"end {i}" for i in dead), *after]
    running = most = 0
    for event in ordered:
        running += 1 if event.startswith("start ") else -1
        most = max(most, running)
    return most


def _quick_redelivery(module_prefix: str) -> dict[str, object]:
    """Broker options under which a dead worker's unacknowledged messages come back in
    seconds (to a worker that is still alive). Not in fewer: on a loaded host a live worker's
    own messages waiting for a slot could outlast a shorter timeout and come back as well,
    as a second copy of a task (seen with 4 s, three test processes and a busy loop on two
    cores)."""
    return {
        "global_keyprefix": f"{module_prefix}:kombu:",
        "visibility_timeout": 10,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed while it held kombu's lock on the unacknowledged messages (a green
        # worker's consumer sweeps them at every idle poll) keeps every other worker from
        # giving them back until the lock expires: 300 s by default.
        "unacked_mutex_expire": 5,
    }


def _ids(events: list[str], kind: str) -> list[str]:
    return [event.split(" ", 1)[1] for event in events if event.startswith(kind + " ")]


@pytest.mark.slow
def test_celery_redsem_status_shows_a_parked_backlog_in_line_order(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # 30 tasks of 0.3 s on one key (limit 3) through one worker of 4 slots: the backlog is
    # parked in the worker, and `celery redsem status` lists it in line order.
    queue = f"status-{key}"
    with running_workers(redis_url, module_prefix, tmp_path, ["st"], 4, "-Q", queue):
        sent = [app.tasks["t.counted"].apply_async((key, 0.3), queue=queue) for _ in range(30)]
        ids = {result.id for result in sent}
        sem = holder(app, f"counted:{key}", 3)
        wait_until(lambda: len(sem.waiters()) >= 20, 30, what="the backlog parked in line")
        obj = CLIContext(app=app, no_color=True, workdir=None)
        shown = CliRunner().invoke(redsem, ["status", f"counted:{key}", "--json"], obj=obj)
        assert shown.exit_code == 0, shown.output
        (state,) = json.loads(shown.output)["semaphores"]
        waiters = state["waiters"]
        assert len(waiters) >= 15
        assert {w["permit_id"] for w in waiters} <= ids
        tickets = [w["ticket"] for w in waiters]
        assert tickets == sorted(tickets)  # first in line first
        text = CliRunner().invoke(redsem, ["status", f"counted:{key}"], obj=obj).output
        places = [
            line.split()[1] for line in text.splitlines() if line.strip().startswith("waiter")
        ]
        assert places[:3] == ["#1", "#2", "#3"]
        assert all(result.get(timeout=60)["name"] == f"counted:{key}" for result in sent)


@pytest.mark.slow
def test_a_backlog_is_parked_and_nothing_is_lost_or_run_twice_when_a_worker_is_killed(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # 40 tasks of 0.15 s on one key (limit 3) through two workers of 2 slots each: the backlog
    # is parked in the workers. Then one worker (main process and children) is SIGKILLed while
    # it holds part of the backlog: the bodies it was running are lost with it (their messages
    # were acknowledged when they started, as Celery does by default), and the tasks it had
    # parked (unacknowledged) are delivered again to the other worker. Every task starts
    # exactly once, and never more than 3 at once.
    queue = f"backlog-{key}"
    transport = _quick_redelivery(module_prefix)
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path,
        ["b0", "b1"],
        2,
        "-Q",
        queue,
        broker_transport_options=transport,
    ) as (victim, survivor):
        sent = [app.tasks["t.counted"].apply_async((key, 0.15), queue=queue) for _ in range(40)]
        ids = {result.id for result in sent}
        wait_until(lambda: len(_ids(_log(app, key), "end")) >= 6, 30, what="the backlog under way")
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        killed_at = len(_log(app, key))
        # Permits held when it died (they end with their 1 s leases): a task the victim's
        # child had taken (acknowledged, as Celery does when a child accepts a task) and
        # granted, but not yet begun, is lost with it like a body it was running. A standby
        # holds no permit while it waits: lost, it would show here as never started.
        held_at_kill = {h.permit_id for h in holder(app, f"counted:{key}", 3).holders()}

        # The dead worker's running bodies never end; every other task ends on the survivor.
        def settled() -> bool:
            events = _log(app, key)
            started, ended = set(_ids(events, "start")), set(_ids(events, "end"))
            lost = (started - ended) | (ids - started)
            return len(lost) <= 2 and started | (held_at_kill & ids) >= ids

        try:
            wait_until(settled, 60, what="every task started, all but the dead ones ended")
        except AssertionError:
            events = _log(app, key)
            started, ended = set(_ids(events, "start")), set(_ids(events, "end"))
            never = sorted(ids - started)
            states = {i: app.AsyncResult(i).state for i in never}
            print(survivor.log())
            raise AssertionError(
                f"never started: {states}; started, not ended: {sorted(started - ended)}; "
                f"line: {[w.permit_id for w in holder(app, f'counted:{key}', 3).waiters()]}"
            ) from None
        assert survivor.alive()
    events = _log(app, key)
    starts = _ids(events, "start")
    assert len(starts) == len(set(starts)), "a task ran twice"
    never = ids - set(starts)
    assert never <= held_at_kill, "a task never ran that the victim had not begun"
    assert _most_at_once(events, killed_at) <= 3
    lost_mid_body = set(starts) - set(_ids(events, "end"))
    assert len(lost_mid_body | never) <= 2  # the victim's two slots at most
    # Every task that started after the kill ran to its end on the survivor and has its
    # result. (One whose body ended on the victim may have died before its result was stored.)
    after_kill = set(_ids(events[killed_at:], "start"))
    assert after_kill, "the survivor ran nothing after the kill"
    for result in sent:
        if result.id in after_kill:
            assert result.get(timeout=10)["name"] == f"counted:{key}"
    # The dead worker's permits end with their leases; nothing is left in line.
    sem = holder(app, f"counted:{key}", 3)
    wait_until(lambda: sem.state().holders == [] and sem.state().waiters == [], 15, what="empty")


@pytest.mark.slow
def test_a_standby_killed_before_its_turn_is_delivered_again_and_runs_once(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # Lock on one key, three tasks through a worker of three slots: A runs, B and C park. When
    # A ends here, B gets the lock and C goes to a spare slot as the lock's standby, waiting
    # in its child for B's release. The worker is SIGKILLed then: B's body is lost with it (its
    # message was acknowledged as it started, as Celery does by default), but C's message was
    # held back until C's grant, so the broker delivers C again and it runs, once, elsewhere.
    queue = f"standby-{key}"
    transport = _quick_redelivery(module_prefix)
    conf = {"broker_transport_options": transport, "redsem_head_wait": 5.0}
    locked = app.tasks["t.locked"]
    node = f"v-{key}@{os.uname().nodename}"
    inspect = app.control.inspect(timeout=1.0, destination=[node])
    with running_workers(
        redis_url, module_prefix, tmp_path, [f"v-{key}"], 3, "-Q", queue, **conf
    ) as (victim,):
        first = locked.apply_async((key, 2.0), queue=queue)
        second = locked.apply_async((key, 2.0), queue=queue)
        wait_until(lambda: "start " + second.id in _log(app, key), 30, what="B started")
        third = locked.apply_async((key, 0.1), queue=queue)
        wait_until(
            lambda: third.id in {t["id"] for ts in (inspect.active() or {}).values() for t in ts},
            5,
            what="C waiting as the standby in a pool child",
        )
        assert "start " + third.id not in _log(app, key)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
    assert first.get(timeout=10)["name"] == f"locked:{key}"
    with running_workers(redis_url, module_prefix, tmp_path, [f"s-{key}"], 2, "-Q", queue, **conf):
        assert third.get(timeout=30)["name"] == f"locked:{key}"
    events = _log(app, key)
    assert sorted(_ids(events, "start")) == sorted([first.id, second.id, third.id])
    assert sorted(_ids(events, "end")) == sorted([first.id, third.id])  # B died mid-body
