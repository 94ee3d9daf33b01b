"""Admission at dispatch in real prefork workers: a task without its permit holds no pool slot."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from celery import Celery

from celery_redsem import AcquireTimeout
from celery_redsem.integration.admission import gate
from celery_redsem.integration.admission.gate import SLOW_CALLS_IN_ROW, SlowKeyFunctions
from celery_redsem.integration.policy import (
    FIRST_PARK,
    MAX_PARK,
    MAX_PARKED,
    MIN_PARK,
    park_time,
)
from tests.integration.conftest import (
    WorkerProcess,
    blocked,
    forged_grant_runs_nothing,
    holder,
    retried_run_waits_for_the_run_that_queued_it,
    running_workers,
)
from tests.servers import wait_until


def test_park_time_follows_the_line_and_is_bounded() -> None:
    # Unknown hold: short, doubling with each try, capped.
    assert park_time(position=3, limit=2, hold=None, tries=0) == FIRST_PARK
    assert park_time(position=3, limit=2, hold=None, tries=2) == 4 * FIRST_PARK
    assert park_time(position=3, limit=2, hold=None, tries=30) == MAX_PARK
    assert park_time(position=3, limit=2, hold=None, tries=5000) == MAX_PARK  # no overflow
    # Known hold: a little before `position` holders of `hold` left a `limit` semaphore.
    assert 0.6 * 1.0 < park_time(position=4, limit=2, hold=0.5, tries=0) < 1.0
    assert park_time(position=1, limit=100, hold=0.001, tries=0) == MIN_PARK
    assert park_time(position=10_000, limit=1, hold=60.0, tries=0) == MAX_PARKED
    assert park_time(position=10_000, limit=1, hold=60.0, tries=0, longest=7.0) == 7.0
    # Unknown hold, deep in line: a round of holders at a time, still capped.
    assert park_time(position=10, limit=2, hold=None, tries=0) == 5 * FIRST_PARK
    assert park_time(position=10_000, limit=2, hold=None, tries=0) == MAX_PARK


@pytest.fixture(scope="module")
def admitting_workers(
    redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    """Two prefork workers with 2 slots each and admission on (the default).

    ``redsem_head_wait`` is long: a task that reached a child without its permit would sit in
    its slot for up to 10 s, which the tests below would see as an active task.
    """
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path_factory.mktemp("admission"),
        ["a0", "a1"],
        2,
        redsem_head_wait=10.0,
    ) as procs:
        yield procs


def _counter(app: Celery) -> redis.Redis:
    return redis.Redis.from_url(app.conf.broker_url)


def _task_ids(replies: dict[str, list[dict[str, object]]] | None) -> set[str]:
    return {str(task["id"]) for tasks in (replies or {}).values() for task in tasks}


def _answered(replies: dict[str, list[dict[str, object]]] | None, nodes: list[str]) -> set[str]:
    """The task ids in ``replies``, which must hold an answer from every node in ``nodes``
    (no answer in time would read as "no tasks", and a check on it would pass vacuously)."""
    assert replies is not None, f"no answer from {nodes}"
    assert set(nodes) <= set(replies), f"no answer from {set(nodes) - set(replies)}"
    return _task_ids(replies)


def _nodes(names: list[str]) -> list[str]:
    return [f"{name}@{socket.gethostname()}" for name in names]


@pytest.mark.slow
def test_limit_holds_across_workers_without_contention_retries(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    # 10 tasks: even if one worker takes them all, its 2 slots and 8 parked tasks (one
    # widening of its window of 2 x 4) hold them; a task past that would go to its child.
    results = [app.tasks["t.counted"].delay(key, 0.1) for _ in range(10)]
    outs = [r.get(timeout=60) for r in results]
    prefix = app.conf.redsem_key_prefix
    # Never passed; reached where the tasks were spread over both workers (a worker that took
    # all ten, the other slow to fetch on a loaded host, runs 2 at a time: its slots). That the
    # limit is reached across workers is test_workers' check, with 40 tasks.
    assert 2 <= int(_counter(app).get(f"{prefix}:t:max:{key}") or 0) <= 3
    assert int(_counter(app).get(f"{prefix}:t:cur:{key}") or 0) == 0
    # 4 slots, limit 3: tasks were contended, and waited parked, never through a retry.
    assert all(out["contention_retries"] == 0 and out["retries"] == 0 for out in outs)
    state = holder(app, f"counted:{key}", 3).state()
    assert state.holders == []
    assert state.waiters == []


@pytest.mark.slow
def test_a_parked_task_holds_no_slot_and_runs_once_the_permit_frees(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    sem, blocker = blocked(app, f"locked:{key}")
    result = app.tasks["t.locked"].delay(key)
    nodes = _nodes(["a0", "a1"])
    inspect = app.control.inspect(timeout=1.0, destination=nodes)
    wait_until(lambda: result.id in _task_ids(inspect.reserved()), 20, what="task reserved")
    # Parked in a worker's main process: reserved, never handed to a child, in line.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert result.id not in _answered(inspect.active(), nodes)
    assert [w.permit_id for w in sem.state().waiters] == [result.id]
    # Others run meanwhile, while it stays parked.
    others = [app.tasks["t.counted"].delay(f"{key}-other", 0.1) for _ in range(3)]
    for other in others:
        other.get(timeout=20)
    assert result.state == "PENDING"
    sem.release(blocker)
    released = time.monotonic()
    out = result.get(timeout=20)
    assert out["contention_retries"] == 0
    assert time.monotonic() - released < MAX_PARK + 1.5  # asked again within its longest park
    assert sem.state().holders == []


@pytest.mark.slow
def test_a_parked_task_fails_visibly_when_its_wait_budget_is_spent(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    sem, blocker = blocked(app, f"budget:{key}")
    started = time.monotonic()
    result = app.tasks["t.budget"].delay(key)  # max_wait=0.5
    with pytest.raises(AcquireTimeout, match=r"max_wait=0\.5"):
        result.get(timeout=20)
    assert time.monotonic() - started < 5.0
    assert result.state == "FAILURE"
    assert sem.state().waiters == []
    sem.release(blocker)


@pytest.mark.slow
def test_a_task_parked_at_warm_shutdown_gets_no_permit_and_runs_after_redelivery(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # The running task ends during the shutdown and wakes the parked one: granted then, it
    # would never run there, and its permit would keep the lock for a lease (30 s here).
    sem = holder(app, f"locked:{key}")
    queue = f"park-{key}"
    conf: dict[str, object] = {"redsem_lease": 30.0}
    first = WorkerProcess(  # two slots: one runs the holder, one is free to park from
        redis_url, module_prefix, "p1", 2, tmp_path / "p1.log", "-Q", queue, conf=conf
    )
    try:
        first.wait_ready()
        running = app.tasks["t.locked"].apply_async((key, 1.0), queue=queue)
        wait_until(lambda: [h.permit_id for h in sem.holders()] == [running.id], 20, what="held")
        result = app.tasks["t.locked"].apply_async((key,), queue=queue)
        wait_until(lambda: len(sem.waiters()) == 1, 20, what="task parked")
    finally:
        first.stop()  # warm shutdown with the task parked: its message goes back to the broker
    assert running.get(timeout=10)["name"] == f"locked:{key}"  # ran to its end
    assert sem.holders() == []  # and no permit went to the task that did not run
    assert result.state == "PENDING"
    second = WorkerProcess(redis_url, module_prefix, "p2", 1, tmp_path / "p2.log", "-Q", queue)
    try:
        second.wait_ready()
        assert result.get(timeout=20)["contention_retries"] == 0
    finally:
        second.stop()


class OneSlot(NamedTuple):
    """A prefork worker with one slot and a prefetch window of 1, on a queue of its own."""

    queue: str
    node: str
    worker: WorkerProcess


@pytest.fixture(scope="module")
def one_slot(
    redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OneSlot]:
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path_factory.mktemp("one-slot"),
        ["slot1"],
        1,
        "-Q",
        "one-slot",
        worker_prefetch_multiplier=1,
    ) as procs:
        yield OneSlot("one-slot", f"slot1@{socket.gethostname()}", procs[0])


@pytest.mark.slow
def test_tasks_behind_a_busy_key_are_parked_and_the_tasks_behind_them_run(
    app: Celery, one_slot: OneSlot, key: str
) -> None:
    # Behind a held lock every task is parked, the prefetch window widening for them, so the
    # worker keeps fetching: a task queued behind them all runs at once, and none of the parked
    # ones goes back through the broker. They stand in line in the order they were sent.
    sem, blocker = blocked(app, f"locked:{key}")
    results = [app.tasks["t.locked"].apply_async((key,), queue=one_slot.queue) for _ in range(6)]
    other = app.tasks["t.counted"].apply_async((f"{key}-other", 0.0), queue=one_slot.queue)
    assert other.get(timeout=20)["contention_retries"] == 0
    wait_until(
        lambda: [w.permit_id for w in sem.state().waiters] == [r.id for r in results],
        10,
        what="every task parked, in line in the order sent",
    )
    assert {r.state for r in results} == {"PENDING"}  # none ran, none was retried
    assert [h.permit_id for h in sem.state().holders] == [blocker.id]
    sem.release(blocker)
    outs = [r.get(timeout=30) for r in results]
    assert all(out["contention_retries"] == 0 for out in outs)  # no trip through the broker
    assert sem.state().holders == []
    assert sem.state().waiters == []


@pytest.mark.slow
def test_a_run_that_ends_gives_its_slot_to_the_next_task_parked_on_its_semaphore(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    """Two slots: ``first`` holds lock K in one, ``second`` (on K) is parked, ``filler``
    (lock K2) holds the other slot, and ``other`` (a third key, sent last) waits for a slot.
    When ``first`` ends, ``second`` takes its slot: the pool gives a slot back before the
    run's end wakes the parked task, so admission has it given back a step later, and
    ``other`` runs after ``second``, as sent."""
    queue, prefix = f"hand-on-{key}", app.conf.redsem_key_prefix
    lock, filler_lock = holder(app, f"long:{key}"), holder(app, f"long:{key}-2")
    held_long, counter = app.tasks["t.held_long"], _counter(app)
    with running_workers(redis_url, module_prefix, tmp_path, ["hand"], 2, "-Q", queue):
        first = held_long.apply_async((key,), queue=queue)
        wait_until(lambda: [h.permit_id for h in lock.state().holders] == [first.id], 20)
        second = held_long.apply_async((key,), queue=queue)
        wait_until(lambda: [w.permit_id for w in lock.state().waiters] == [second.id], 20)
        filler = held_long.apply_async((f"{key}-2",), queue=queue)
        wait_until(lambda: [h.permit_id for h in filler_lock.state().holders] == [filler.id], 20)
        other = app.tasks["t.counted"].apply_async((f"{key}-3", 0.0), queue=queue)
        inspect = app.control.inspect(timeout=1.0, destination=_nodes(["hand"]))
        wait_until(lambda: other.id in _task_ids(inspect.reserved()), 20, what="other received")
        counter.rpush(f"{prefix}:t:go:{key}", 1, 1)  # both runs on K end
        assert [first.get(timeout=20), second.get(timeout=20)] == ["done", "done"]
        other.get(timeout=20)
        counter.rpush(f"{prefix}:t:go:{key}-2", 1)
        assert filler.get(timeout=20) == "done"
    done = {"second": second.date_done, "other": other.date_done}
    assert None not in done.values(), done
    assert done["second"] < done["other"], "the task on another key took the freed slot"


@pytest.mark.slow
def test_a_slow_key_function_is_left_to_the_pool_children(
    app: Celery, one_slot: OneSlot, key: str
) -> None:
    # Admission runs the key function in the worker's main process, where a slow one holds
    # up every dispatch: once it was slow SLOW_CALLS_IN_ROW times in a row, the task asks for
    # its permit in its child.
    calls = f"{app.conf.redsem_key_prefix}:t:keypids:{key}"
    main_pid = str(one_slot.worker.proc.pid)
    for _ in range(SLOW_CALLS_IN_ROW):
        assert "the key function of t.slow_key took" not in one_slot.worker.log()
        app.tasks["t.slow_key"].apply_async((key,), queue=one_slot.queue).get(timeout=20)
    assert main_pid in [pid.decode() for pid in _counter(app).lrange(calls, 0, -1)]
    assert "the key function of t.slow_key took over" in one_slot.worker.log()
    _counter(app).delete(calls)
    app.tasks["t.slow_key"].apply_async((key,), queue=one_slot.queue).get(timeout=20)
    pids = [pid.decode() for pid in _counter(app).lrange(calls, 0, -1)]
    assert pids, "the key function did not run"
    assert main_pid not in pids  # only the pool child ran it
    assert holder(app, f"slowkey:{key}").state().holders == []


@pytest.mark.slow
def test_two_deliveries_of_one_task_id_parked_together_both_run(
    app: Celery, one_slot: OneSlot, key: str
) -> None:
    # A dedupe id chosen by the caller, or a redelivery: both copies are parked on one worker.
    sem, blocker = blocked(app, f"locked:{key}")
    task_id = f"same-{key}"
    for _ in range(2):
        app.tasks["t.locked"].apply_async((key,), queue=one_slot.queue, task_id=task_id)
    inspect = app.control.inspect(timeout=1.0, destination=[one_slot.node])
    wait_until(
        lambda: (
            sum(t["id"] == task_id for ts in (inspect.reserved() or {}).values() for t in ts) == 2
        ),
        20,
        what="both copies parked",
    )
    sem.release(blocker)
    runs = f"{app.conf.redsem_key_prefix}:t:log:{key}"
    wait_until(lambda: _counter(app).llen(runs) == 4, 20, what="both copies to run")
    assert (
        sorted(_counter(app).lrange(runs, 0, -1))
        == [f"end {task_id}".encode()] * 2 + [f"start {task_id}".encode()] * 2
    )


@pytest.mark.slow
def test_a_task_revoked_while_it_waits_gives_up_its_place(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    sem, blocker = blocked(app, f"locked:{key}")
    result = app.tasks["t.locked"].delay(key)
    wait_until(
        lambda: [w.permit_id for w in sem.state().waiters] == [result.id], 20, what="task in line"
    )
    app.control.revoke(result.id)
    # Given up when the worker drops it (it asks again within MAX_PARK), long before its
    # place would expire by itself (redsem_waiter_margin, 5 s, after its last ask).
    wait_until(lambda: sem.state().waiters == [], 4, what="its place in line given up")
    wait_until(lambda: result.state == "REVOKED", 10, what="the task revoked")
    assert [h.permit_id for h in sem.state().holders] == [blocker.id]  # nobody else got in
    sem.release(blocker)


@pytest.mark.slow
def test_a_forged_grant_header_is_dropped_at_dispatch(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    forged_grant_runs_nothing(app, key)


def _runs(app: Celery, key: str) -> int:
    """How many bodies of ``t.locked`` / ``t.counted`` started for ``key`` (see tasks.py)."""
    log = _counter(app).lrange(f"{app.conf.redsem_key_prefix}:t:log:{key}", 0, -1)
    return sum(1 for entry in log if entry.startswith(b"start "))


@pytest.mark.slow
@pytest.mark.parametrize("slot_wait", [False, True])
def test_a_long_parked_task_is_retried_before_the_broker_would_deliver_it_again(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str, slot_wait: bool
) -> None:
    # A parked message is unacknowledged: held past the broker's visibility timeout (4 s; the
    # broker looks every second) it would be delivered again, and both copies (one task id,
    # so one permit) would run. Parking ends half that timeout after delivery, time spent
    # waiting for a slot included: then the child retries the task, acknowledging the message.
    queue = f"vis-{key}"
    sem, blocker = blocked(app, f"locked:{key}")
    transport = {
        "global_keyprefix": f"{module_prefix}:kombu:",
        "visibility_timeout": 4,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path,
        ["vis"],
        1,
        "-Q",
        queue,
        broker_transport_options=transport,
    ) as (proc,):
        if slot_wait:  # the one slot is busy well past the longest park (2 s)
            app.tasks["t.locked"].apply_async((f"{key}-ahead", 3.0), queue=queue)
        result = app.tasks["t.locked"].apply_async((key,), queue=queue)
        received = f"t.locked[{result.id}] received"
        wait_until(
            lambda: proc.log().count(received) >= 3,
            timeout=30,
            what="the task to be retried through the broker twice",
        )
        assert not result.ready()
        sem.release(blocker)
        assert result.get(timeout=20)["contention_retries"] >= 2
        node = _nodes(["vis"])
        inspect = app.control.inspect(timeout=1.0, destination=node)
        wait_until(
            lambda: (
                result.id
                not in _answered(inspect.reserved(), node) | _answered(inspect.active(), node)
            ),
            timeout=20,
            what="no copy of the task left in the worker",
        )
        assert _runs(app, key) == 1


@pytest.mark.slow
def test_a_grant_that_waited_for_a_slow_child_is_asked_for_again(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # The main process grants at dispatch; a replacement child that takes longer than a lease
    # to start gets a grant that nothing refreshed meanwhile, which may have gone to somebody
    # else. The child asks again instead of running on it.
    queue = f"slow-{key}"
    sem = holder(app, f"locked:{key}", lease=30.0)
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path,
        ["slow"],
        1,
        "-Q",
        queue,
        "--max-tasks-per-child=1",
        test_child_init_sleep=2.5,
        redsem_lease=1.0,
    ):
        app.tasks["t.locked"].apply_async((key,), queue=queue).get(timeout=30)  # child 1 ends
        result = app.tasks["t.locked"].apply_async((key,), queue=queue)  # for child 2, starting
        wait_until(
            lambda: [h.permit_id for h in sem.state().holders] == [result.id],
            timeout=10,
            what="the grant made at dispatch",
        )
        granted = sem.state().holders[0]
        wait_until(lambda: sem.state().now_ms > granted.expires_at, timeout=10, what="it to expire")
        other = sem.acquire()
        assert other is not None  # the lock went to somebody else meanwhile
        wait_until(
            lambda: result.id in [w.permit_id for w in sem.state().waiters] or result.ready(),
            timeout=20,
            what="the child to start and ask again",
        )
        assert not result.ready()  # it did not run on the expired grant
        sem.release(other)
        out = result.get(timeout=30)
        assert out["token"] > other.token
        assert _runs(app, key) == 2


@pytest.mark.slow
def test_a_task_with_two_guards_goes_to_its_child_and_holds_both(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    # Admission decides only for one guard; the child asks for both, in order.
    outs = [r.get(timeout=30) for r in [app.tasks["t.two_guards"].delay(key) for _ in range(3)]]
    for out in outs:
        assert out["id"] in out["outer"]
        assert len(out["outer"]) <= 2  # its limit
        assert out["inner"] == [out["id"]]
    assert holder(app, f"outer:{key}", 2).state().holders == []
    assert holder(app, f"inner:{key}").state().holders == []


@pytest.mark.slow
def test_two_deliveries_of_one_task_id_run_one_after_the_other(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # Both copies share the task id's permit: run at once, the first one's end would release
    # it under the second. With two free slots, the second copy waits for the first to end.
    queue = f"copies-{key}"
    sem, blocker = blocked(app, f"locked:{key}")
    task_id = f"same-{key}"
    with running_workers(redis_url, module_prefix, tmp_path, ["copies"], 2, "-Q", queue):
        for _ in range(2):
            app.tasks["t.locked"].apply_async((key, 0.5), queue=queue, task_id=task_id)
        inspect = app.control.inspect(timeout=1.0, destination=_nodes(["copies"]))
        wait_until(
            lambda: sum(t == task_id for t in _reserved_ids(inspect)) == 2,
            20,
            what="both copies parked",
        )
        sem.release(blocker)
        runs = f"{app.conf.redsem_key_prefix}:t:log:{key}"
        wait_until(lambda: _counter(app).llen(runs) == 4, 20, what="both copies to run")
    log = [entry.decode() for entry in _counter(app).lrange(runs, 0, -1)]
    assert log == [f"start {task_id}", f"end {task_id}"] * 2
    assert sem.state().holders == []


def _reserved_ids(inspect: Any) -> list[str]:
    return [str(t["id"]) for ts in (inspect.reserved() or {}).values() for t in ts]


def test_a_run_the_body_retried_into_is_parked_until_the_run_that_queued_it_ends(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    # Admission asks for the retried run under its own permit id: it is parked, not handed
    # the ending run's grant (and not mistaken for a second delivery of that run).
    retried_run_waits_for_the_run_that_queued_it(app, key)


@pytest.mark.slow
def test_task_ids_starting_with_a_colon_run_and_every_slot_is_left(
    app: Celery, admitting_workers: list[WorkerProcess], key: str
) -> None:
    # A permit id may not start with ':' (the semaphore's own fields do): such a task id is
    # mapped, so its ask ahead of a slot no longer fails; and whatever fails there, the task
    # is asked for again when it takes its slot (issue 39, item 3: it used to hold a slot
    # forever). Then every one of the workers' 4 slots still runs a task at once.
    results = [
        app.tasks["t.counted"].apply_async((key, 0.05), task_id=f":{key}-{i}") for i in range(8)
    ]
    assert all(r.get(timeout=30)["name"] == f"counted:{key}" for r in results)
    counter = _counter(app)
    prefix = app.conf.redsem_key_prefix
    held = [app.tasks["t.fifo"].delay(f"{key}-{i}", str(i), -1) for i in range(4)]
    try:
        wait_until(
            lambda: sum(counter.llen(f"{prefix}:t:order:{key}-{i}") for i in range(4)) == 4,
            30,
            what="four bodies running at once on four slots",
        )
    finally:
        for i in range(4):
            counter.rpush(f"{prefix}:t:go:{key}-{i}", 1)
    assert [r.get(timeout=30)["tag"] for r in held] == ["0", "1", "2", "3"]


@pytest.mark.slow
def test_a_key_function_slow_at_first_holds_up_no_other_task(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # Its first call (3 s) runs in a thread of its own, waited for 50 ms: the other tasks sent
    # meanwhile are dispatched at once (they started 3 s late, once per task name and worker
    # start), and the task itself asks in its pool child.
    queue = f"slowfirst-{key}"
    with running_workers(redis_url, module_prefix, tmp_path, ["sf"], 3, "-Q", queue) as (w,):
        slow = app.tasks["t.slow_first"].apply_async((key,), queue=queue)
        calls = f"{app.conf.redsem_key_prefix}:t:keypids:{key}"
        main_pid = str(w.proc.pid).encode()
        wait_until(  # the slow first call under way in the worker's main process
            lambda: main_pid in _counter(app).lrange(calls, 0, -1), 20, what="the first call"
        )
        sent = time.monotonic()
        quick = [app.tasks["t.plain"].apply_async((str(i),), queue=queue) for i in range(4)]
        assert [r.get(timeout=20) for r in quick] == ["0", "1", "2", "3"]
        assert time.monotonic() - sent < 2.0  # not behind the 3 s call
        assert slow.get(timeout=20) == "ran"
        # Quick from then on: admission keeps deciding for it in the main process (one slow
        # call left it to the pool children for good before).
        assert app.tasks["t.slow_first"].apply_async((key,), queue=queue).get(timeout=20) == "ran"
        assert "the key function of t.slow_first took" not in w.log()


def test_one_slow_key_call_in_a_row_of_quick_ones_keeps_admission() -> None:
    # On a loaded host a trivial key function took 79 ms once, and its task lost admission
    # for good (its tasks went round the broker as retries).
    slow = SlowKeyFunctions()
    assert slow.call("t", lambda: "k") == "k"  # (the first call, in a thread, came back)
    for _ in range(5):
        slow.timed("t", gate.SLOW_KEY_FUNCTION * 2)
        slow.timed("t", 0.001)
    assert "t" not in slow


def test_slow_key_calls_in_a_row_leave_the_task_to_its_children_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = SlowKeyFunctions()
    assert slow.call("t", lambda: "k") == "k"
    for _ in range(SLOW_CALLS_IN_ROW - 1):
        slow.timed("t", gate.SLOW_KEY_FUNCTION * 2)
    assert "t" not in slow
    slow.timed("t", gate.SLOW_KEY_FUNCTION * 2)
    assert "t" in slow
    monkeypatch.setattr(gate, "RETRY_SLOW_AFTER", 0.0)  # its time is up: tried again
    assert "t" not in slow
    release = threading.Event()
    assert slow.call("t", lambda: release.wait(5)) is None  # still slow: left again
    release.set()
    monkeypatch.setattr(gate, "RETRY_SLOW_AFTER", 60.0)
    assert "t" in slow
    monkeypatch.setattr(gate, "RETRY_SLOW_AFTER", 0.0)
    assert slow.call("t", lambda: "quick") == "quick"  # quick again: back in admission
    monkeypatch.setattr(gate, "RETRY_SLOW_AFTER", 60.0)
    assert "t" not in slow
