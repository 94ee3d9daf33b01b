"""Real ``celery worker`` subprocesses (prefork): limits across workers, kills, shutdown."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError

from celery_redsem import PermitLost
from celery_redsem.integration.worker.request import has_child_processes
from tests.integration.conftest import (
    WorkerProcess,
    holder,
    retried_run_waits_for_the_run_that_queued_it,
    running_workers,
)
from tests.servers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers(
    redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    """Two prefork workers with 4 slots each, consuming the default queue.

    Admission at dispatch is off and they never wait at the head of the line
    (``redsem_head_wait=0``), so contention always goes through Celery retries (the path of
    pools without admission; ``test_admission`` covers the default).
    """
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path_factory.mktemp("workers"),
        ["w0", "w1"],
        4,
        redsem_head_wait=0.0,
        redsem_worker_admission=False,
    ) as procs:
        yield procs


def _counter(app: Celery) -> redis.Redis:
    return redis.Redis.from_url(app.conf.broker_url)


def _pid(app: Celery, key: str) -> int:
    value = wait_until(
        lambda: _counter(app).get(f"{app.conf.redsem_key_prefix}:t:pid:{key}"),
        20,
        what="task started",
    )
    assert isinstance(value, bytes)
    return int(value)


def _released_by_main_process(workers: list[WorkerProcess], task_id: str) -> bool:
    """Whether a worker's main process logged releasing ``task_id``'s permit for its child
    (waiting a moment for the line: it is logged just after the release)."""
    try:
        wait_until(
            lambda: any(f"[{task_id}] for its lost child" in proc.log() for proc in workers),
            2,
            what="the main process's release in the log",
        )
    except AssertionError:
        return False
    return True


def test_limit_is_never_exceeded_across_workers(app: Celery, workers: list[WorkerProcess]) -> None:
    keys = ["alpha", "beta"]
    results = [app.tasks["t.counted"].delay(keys[i % 2], 0.15) for i in range(40)]
    outs = [r.get(timeout=60) for r in results]
    prefix = app.conf.redsem_key_prefix
    for key in keys:
        assert int(_counter(app).get(f"{prefix}:t:max:{key}") or 0) == 3  # reached, never passed
        assert int(_counter(app).get(f"{prefix}:t:cur:{key}") or 0) == 0
    assert all(out["retries"] == 0 for out in outs)  # max_retries=0, yet ...
    assert max(out["contention_retries"] for out in outs) >= 1  # ... they waited through retries
    for key in keys:
        state = holder(app, f"counted:{key}", 3).state()
        assert state.holders == []
        assert state.waiters == []


@pytest.mark.parametrize("retried", [False, True])
def test_sigkill_of_a_child_frees_its_permit_from_the_main_process(
    app: Celery, workers: list[WorkerProcess], key: str, retried: bool
) -> None:
    # lease 10 s: only a release frees it soon; a run the task's own retry queued has a permit
    # id of its own, which the main process must work out from the message too.
    result = app.tasks["t.until_killed"].delay(key, retry_first=retried)
    pid = _pid(app, key)
    sem = holder(app, f"killed:{key}")
    run_id = f"{result.id}~1" if retried else result.id
    assert [h.permit_id for h in sem.state().holders] == [run_id]
    os.kill(pid, signal.SIGKILL)  # the child can run nothing: the main process releases
    wait_until(lambda: sem.state().holders == [], 8, what="permit freed")
    assert _released_by_main_process(workers, result.id)
    with pytest.raises(WorkerLostError):  # and the main process saw the loss
        result.get(timeout=15)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_revoke_with_terminate_frees_the_permit(
    app: Celery, workers: list[WorkerProcess], key: str, sig: str
) -> None:
    # SIGTERM: the child's own finally releases; SIGKILL: the main process, on Terminated.
    result = app.tasks["t.until_killed"].delay(key)
    _pid(app, key)
    sem = holder(app, f"killed:{key}")
    assert [h.permit_id for h in sem.state().holders] == [result.id]
    result.revoke(terminate=True, signal=sig)
    # billiard reports a SIGKILLed job a few seconds later; either way, well within the lease.
    wait_until(lambda: sem.state().holders == [], 8, what="permit freed")  # lease is 10 s
    assert _released_by_main_process(workers, result.id) is (sig == "SIGKILL")
    wait_until(lambda: result.state == "REVOKED", 10, what="revoked")


def test_revoke_with_terminate_frees_the_permit_of_an_autoretry_task(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    # autoretry_for replaces task.run; the main process must still find the bound arguments
    # (SIGKILL: the child cannot release it itself).
    result = app.tasks["t.autoretry_killed"].delay(key)
    _pid(app, key)
    sem = holder(app, f"auto:{key}")
    assert [h.permit_id for h in sem.state().holders] == [result.id]
    result.revoke(terminate=True, signal="SIGKILL")
    wait_until(lambda: sem.state().holders == [], 8, what="permit freed")  # lease is 10 s
    assert _released_by_main_process(workers, result.id)


def test_a_child_that_survives_the_terminate_signal_keeps_its_permit(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    result = app.tasks["t.survives_signal"].delay(key)
    _pid(app, key)
    sem = holder(app, f"survivor:{key}")
    cleaning = f"{app.conf.redsem_key_prefix}:t:cleaning:{key}"
    result.revoke(terminate=True, signal="SIGUSR1")  # a soft time limit in the child
    wait_until(lambda: _counter(app).exists(cleaning), 10, what="the body to start cleaning up")
    assert [h.permit_id for h in sem.state().holders] == [result.id]  # still its own
    _counter(app).rpush(f"{app.conf.redsem_key_prefix}:t:cleaned:{key}", 1)  # cleanup may end
    wait_until(lambda: not _counter(app).exists(cleaning), 10, what="the cleanup to end")
    wait_until(lambda: sem.state().holders == [], 3, what="released by the child")


def test_hard_time_limit_frees_the_permit(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    result = app.tasks["t.hard_limit"].delay(key)  # time_limit=1, lease 10 s
    _pid(app, key)
    sem = holder(app, f"hard:{key}")
    wait_until(lambda: sem.state().holders == [], 4, what="permit freed")
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=10)


def test_soft_time_limit_releases_in_the_child(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    result = app.tasks["t.soft_limit"].delay(key)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=15)
    assert holder(app, f"soft:{key}").state().holders == []


def test_a_task_running_many_leases_keeps_its_permit(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    long = app.tasks["t.locked"].delay(key, 3.5)  # lease is 1 s: more than three leases
    sem = holder(app, f"locked:{key}")
    wait_until(
        lambda: [h.permit_id for h in sem.state().holders] == [long.id], 20, what="long task holds"
    )
    short = app.tasks["t.locked"].delay(key, 0.0)
    out = long.get(timeout=30)
    assert not out["lost"]
    short.get(timeout=30)
    prefix = app.conf.redsem_key_prefix
    log = [e.decode() for e in _counter(app).lrange(f"{prefix}:t:log:{key}", 0, -1)]
    assert log == [f"start {long.id}", f"end {long.id}", f"start {short.id}", f"end {short.id}"]
    assert int(_counter(app).get(f"{prefix}:t:max:{key}") or 0) == 1


def test_raise_policy_interrupts_the_body_on_a_lost_lease(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    result = app.tasks["t.lost_raises"].delay(key)
    _pid(app, key)
    sem = holder(app, f"lost:{key}")
    assert sem.release(result.id)  # someone takes the permit away (an operator, an expiry)
    taken = time.monotonic()
    with pytest.raises(PermitLost, match="lost its lease"):
        result.get(timeout=15)
    assert time.monotonic() - taken < 5  # the body was interrupted, not run to its end (30 s)


def test_raise_policy_fails_a_body_that_swallowed_the_interrupt(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    # The body's own `except Exception` caught the interrupt and returned: the task still
    # fails, as it ran on after its permit was gone.
    result = app.tasks["t.lost_swallowed"].delay(key)
    _pid(app, key)
    assert holder(app, f"lost:{key}").release(result.id)  # an operator takes it away
    with pytest.raises(PermitLost, match="lost its lease"):
        result.get(timeout=15)


@pytest.mark.parametrize("policy", ["log", "raise"])
def test_a_permit_taken_away_before_any_refresh_is_reported_when_the_body_ends(
    app: Celery, workers: list[WorkerProcess], key: str, policy: str
) -> None:
    # The body ends long before its first refresh (30 s lease): the release at the end is the
    # first to find the permit gone, and reports it as a refresh would have.
    task = app.tasks["t.held_long" if policy == "log" else "t.held_long_raises"]
    result = task.delay(key)
    _pid(app, key)
    assert holder(app, f"long:{key}").release(result.id)  # an operator takes it away
    _counter(app).rpush(f"{app.conf.redsem_key_prefix}:t:go:{key}", 1)
    go = time.monotonic()
    if policy == "raise":
        with pytest.raises(PermitLost, match="lost its lease"):
            result.get(timeout=15)
    else:
        assert result.get(timeout=15) == "done"  # the body's outcome stands
    assert time.monotonic() - go < 5  # ended on its go, before any refresh could look
    wait_until(
        lambda: any(
            f"permit {result.id!r} of 'long:{key}'" in w.log()
            and "the release found it no longer held" in w.log()
            for w in workers
        ),
        10,
        what="the loss in a worker's log",
    )


def test_a_run_the_body_retried_into_waits_for_the_run_that_queued_it(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    retried_run_waits_for_the_run_that_queued_it(app, key)


def test_a_replacement_run_has_a_permit_of_its_own(
    app: Celery, workers: list[WorkerProcess], key: str
) -> None:
    # self.replace() queues the replacement under the same task id before the body ends.
    result = app.tasks["t.replaced"].delay(key)
    assert result.get(timeout=30) == {"nesting": 1, "permit_id": f"{result.id}~0.1"}
    sem = holder(app, f"replaced:{key}")
    wait_until(lambda: sem.state().holders == [], 5, what="the lock freed")


def test_cold_shutdown_frees_the_permit_from_the_main_process(
    app: Celery, redis_url: str, module_prefix: str, key: str, tmp_path: Path
) -> None:
    cold = WorkerProcess(redis_url, module_prefix, "cold", 1, tmp_path / "cold.log", "-Q", "cold")
    try:
        cold.wait_ready()
        # A body that survives the SIGTERM of a cold shutdown cannot release: the main process
        # kills its child, then releases, before the worker exits.
        result = app.tasks["t.ignores_exit"].apply_async((key,), queue="cold")
        _pid(app, key)
        sem = holder(app, f"stubborn:{key}")
        assert [h.permit_id for h in sem.state().holders] == [result.id]
        cold.signal(signal.SIGQUIT)
        wait_until(lambda: sem.state().holders == [], 5, what="permit freed")  # lease is 10 s
        wait_until(lambda: not cold.alive(), 15, what="the worker to exit")
        assert "released the permit of t.ignores_exit" in cold.log()
    finally:
        cold.stop()


@pytest.mark.parametrize(
    ("pool", "kills"),
    [("prefork", True), (None, True), ("threads", False), ("solo", False), ("gevent", False)],
)
def test_only_a_pool_of_child_processes_has_a_child_to_kill(pool: str | None, kills: bool) -> None:
    # Elsewhere worker_pid is a greenlet's or thread's id: never a process to SIGKILL.
    assert has_child_processes(pool) is kills
