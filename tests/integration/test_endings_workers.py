"""on_busy, dedupe and per-key limits (issue 21) with real ``celery worker`` prefork
subprocesses: admission at dispatch on (the default), two workers of four slots, and a real
``celery beat``.

The workers' ``redsem_dedupe_lease`` is one second, so a run that holds its mark for longer
shows that its mark is renewed; the test process sends with the default (an hour), so a mark
that vanishes within seconds was cleared, not expired (but for the lost-message test).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery, chain, group
from celery.exceptions import WorkerLostError
from celery.result import AsyncResult

from celery_redsem import Busy, RedsemError
from celery_redsem.core.marks import DedupeMark
from tests.integration.apps.busy_tasks import close_busy_app, make_busy_app
from tests.integration.conftest import (
    WorkerProcess,
    blocked,
    holder,
    running_beat,
    running_workers,
)
from tests.servers import wait_until

pytestmark = pytest.mark.slow

WORKER_DEDUPE_LEASE = 1.0
APP_MODULE = "tests.integration.apps.busy_worker_app"


@pytest.fixture(scope="module")
def app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    application = make_busy_app(redis_url, module_prefix)
    yield application
    close_busy_app(application)


@pytest.fixture(scope="module")
def workers(
    redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    with running_workers(
        redis_url,
        module_prefix,
        tmp_path_factory.mktemp("busy-workers"),
        ["b0", "b1"],
        4,
        app_module=APP_MODULE,
        redsem_dedupe_lease=WORKER_DEDUPE_LEASE,
    ) as procs:
        yield procs


@pytest.fixture
def counter(app: Celery) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(app.conf.broker_url)
    yield client
    client.close()


def _count(counter: redis.Redis, app: Celery, what: str, key: str) -> int:
    return int(counter.get(f"{app.conf.redsem_key_prefix}:b:{what}:{key}") or 0)


def _go(counter: redis.Redis, app: Celery, key: str) -> None:
    counter.rpush(f"{app.conf.redsem_key_prefix}:b:go:{key}", 1)


def _skips(counter: redis.Redis, app: Celery, task_id: str) -> list[str]:
    """The reasons of the task_skipped signals the run ``task_id`` sent, in its worker."""
    key = f"{app.conf.redsem_key_prefix}:b:skipped:{task_id}"
    return [r.decode() for r in counter.lrange(key, 0, -1)]


def _mark(counter: redis.Redis, app: Celery, name: str) -> DedupeMark:
    return DedupeMark(counter, name, prefix=app.conf.redsem_key_prefix)


def _mark_key(app: Celery, name: str) -> str:
    return f"{app.conf.redsem_key_prefix}:{{{name}}}:dedupe"


def _marked_for(counter: redis.Redis, app: Celery, name: str) -> str | None:
    found = counter.hget(_mark_key(app, name), "id")
    return found.decode() if found is not None else None


def _lines(workers: list[WorkerProcess], fragment: str) -> list[str]:
    return [line for p in workers for line in p.log().splitlines() if fragment in line]


def test_skip_while_a_run_holds_the_lock(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    first = app.tasks["b.skip"].delay(key, hold=True)
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 30, what="the first run")
    sent = time.monotonic()
    others = [app.tasks["b.skip"].delay(key) for _ in range(3)]
    assert [r.get(timeout=5) for r in others] == [None] * 3
    assert time.monotonic() - sent < 5  # within a few seconds, not after the holder
    assert [r.state for r in others] == ["SUCCESS"] * 3
    assert _count(counter, app, "runs", key) == 1  # no body ran
    assert holder(app, f"skip:{key}").state().waiters == []  # none joined the line
    for result in others:
        assert _skips(counter, app, result.id) == ["busy"]  # the signal, in the child
        fragment = f"b.skip[{result.id}] skipped"
        wait_until(lambda f=fragment: _lines(workers, f), 10, what="the skip's log line")
        (line,) = _lines(workers, fragment)  # one line per skipped run
        assert "INFO" in line
    assert not first.ready()
    _go(counter, app, key)
    assert first.get(timeout=20) == "ran"
    assert app.tasks["b.skip"].delay(key).get(timeout=20) == "ran"  # free again: it runs
    assert _count(counter, app, "runs", key) == 2


def test_fail_raises_busy_at_once_without_joining_the_line(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    sem, blocker = blocked(app, f"skip:{key}")
    sent = time.monotonic()
    result = app.tasks["b.fail"].delay(key)
    with pytest.raises(Busy, match="on_busy='fail'") as raised:
        result.get(timeout=5)
    assert time.monotonic() - sent < 5
    assert isinstance(raised.value, RedsemError)
    assert result.state == "FAILURE"
    state = sem.state()
    assert state.waiters == []  # it never joined the line
    assert [h.permit_id for h in state.holders] == [blocker.id]
    assert _count(counter, app, "runs", key) == 0
    sem.release(blocker)
    assert app.tasks["b.fail"].delay(key).get(timeout=20) == "ran"


def test_five_quick_sends_one_run_then_a_new_one(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    name = f"once:{key}"
    task = app.tasks["b.once"]
    results = [task.delay(key, hold=True) for _ in range(5)]
    assert len({r.id for r in results}) == 1
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 30, what="the run")
    # The run outlives its mark's TTL (the workers' redsem_dedupe_lease) several times: the
    # mark is renewed, never longer than that TTL, and sends still find the run.
    running_since = time.monotonic()
    while time.monotonic() - running_since < 3 * WORKER_DEDUPE_LEASE:
        assert _marked_for(counter, app, name) == results[0].id
        assert 0 < counter.pttl(_mark_key(app, name)) <= WORKER_DEDUPE_LEASE * 1000
        time.sleep(0.1)  # (polling an invariant over a span of time)
    assert task.delay(key).id == results[0].id
    _go(counter, app, key)
    assert results[0].get(timeout=20) == "ran"
    wait_until(lambda: not counter.exists(_mark_key(app, name)), 10, what="the mark cleared")
    again = task.delay(key)  # the run cleared its mark as it ended: a new one is queued
    assert again.id != results[0].id
    assert again.get(timeout=20) == "ran"
    assert _count(counter, app, "runs", key) == 2


def test_a_failed_run_clears_its_mark(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    failed = app.tasks["b.once"].delay(key, boom=True)
    with pytest.raises(RuntimeError, match="boom"):
        failed.get(timeout=20)
    wait_until(lambda: not counter.exists(_mark_key(app, f"once:{key}")), 10, what="cleared")
    assert app.tasks["b.once"].delay(key).get(timeout=20) == "ran"


def test_a_run_revoked_before_it_started_clears_its_mark(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    task = app.tasks["b.once"]
    later = task.apply_async((key,), countdown=1)  # queued (held by a worker), not running
    assert task.delay(key).id == later.id
    later.revoke()
    wait_until(lambda: not counter.exists(_mark_key(app, f"once:{key}")), 15, what="cleared")
    assert later.state == "REVOKED"
    assert _count(counter, app, "runs", key) == 0
    assert task.delay(key).get(timeout=20) == "ran"


def test_an_expired_message_clears_its_mark(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    task = app.tasks["b.once"]
    expired = task.apply_async((key,), countdown=1, expires=0.5)  # expired once it is due
    assert task.delay(key).id == expired.id
    wait_until(lambda: not counter.exists(_mark_key(app, f"once:{key}")), 15, what="cleared")
    assert expired.state == "REVOKED"
    assert _count(counter, app, "runs", key) == 0
    assert task.delay(key).get(timeout=20) == "ran"


def test_a_lost_child_clears_its_mark(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    task = app.tasks["b.once"]
    lost = task.delay(key, hold=True)
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 30, what="the run")
    assert task.delay(key).id == lost.id
    pid_key = f"{app.conf.redsem_key_prefix}:b:pid:{key}"
    wait_until(lambda: counter.get(pid_key), 10, what="the body's pid")
    # (never os.kill(0, ...): that is this whole process group)
    os.kill(int(counter.get(pid_key) or 0), signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        lost.get(timeout=20)
    wait_until(lambda: not counter.exists(_mark_key(app, f"once:{key}")), 10, what="cleared")
    # The worker's main process released the permit and the mark of its lost child.
    wait_until(lambda: _lines(workers, f"b.once[{lost.id}] for its lost child"), 10)
    again = task.delay(key)
    assert again.id != lost.id
    assert again.get(timeout=20) == "ran"


def test_a_lost_message_frees_the_key_after_the_lease(
    redis_url: str, app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    sender = make_busy_app(redis_url, app.conf.redsem_key_prefix, redsem_dedupe_lease=1.0)
    try:
        key = uuid.uuid4().hex[:10]
        task = sender.tasks["b.once"]
        lost = task.apply_async((key,), queue="nobody-consumes-this")
        assert task.delay(key).id == lost.id
        # Sent again and again meanwhile (say by beat): the sends do not keep the mark alive.
        again = wait_until(
            lambda: (r := task.delay(key)).id != lost.id and r, 10, what="the mark to lapse"
        )
        assert isinstance(again, AsyncResult)
        assert again.get(timeout=20) == "ran"
    finally:
        close_busy_app(sender)


def test_send_task_by_name_ends_as_a_duplicate(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    first = app.tasks["b.once"].delay(key, hold=True)
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 30, what="the run")
    by_name = app.send_task("b.once", (key,), kwargs={"hold": True})
    wait_until(lambda: _lines(workers, f"b.once[{by_name.id}] received"), 20, what="received")
    assert _marked_for(counter, app, f"once:{key}") == first.id  # still the first run's
    assert app.tasks["b.once"].delay(key).id == first.id
    _go(counter, app, key)
    assert first.get(timeout=20) == "ran"
    assert by_name.get(timeout=20) is None
    assert by_name.state == "SUCCESS"
    assert _skips(counter, app, by_name.id) == ["duplicate"]
    assert _count(counter, app, "runs", key) == 1


def test_canvas_steps_of_a_marked_key_end_as_duplicates_and_the_canvas_completes(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    # (The two chains' other steps have keys of their own: on one key, one of those steps
    # could find the other running and be skipped.)
    key, other, another = (uuid.uuid4().hex[:10] for _ in range(3))
    once = app.tasks["b.once"]
    the_group = group(once.si(key, hold=True) for _ in range(3)).apply_async()
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 30, what="one run")
    the_chain = chain(once.si(key, hold=True), app.tasks["b.skip"].si(other)).apply_async()
    ends_with = chain(app.tasks["b.skip"].si(another), once.si(key, hold=True)).apply_async()
    wait_until(lambda: _lines(workers, f"[{ends_with.id}] received"), 30, what="its last step")
    assert once.delay(key).id in {r.id for r in the_group.results}
    _go(counter, app, key)
    assert sorted(the_group.get(timeout=30), key=str) == [None, None, "ran"]
    assert the_chain.get(timeout=30) == "ran"  # its first step was a duplicate; the next ran
    assert ends_with.get(timeout=30) is None  # its last step was one
    assert the_chain.parent is not None
    assert the_chain.parent.get(timeout=5) is None
    assert _count(counter, app, "runs", key) == 1
    assert (_count(counter, app, "runs", other), _count(counter, app, "runs", another)) == (1, 1)
    duplicates = [r.id for r in the_group.results if r.result is None]
    assert [_skips(counter, app, i) for i in duplicates] == [["duplicate"]] * 2


def test_beat_does_not_pile_up_runs_of_a_marked_key(
    redis_url: str,
    app: Celery,
    workers: list[WorkerProcess],
    counter: redis.Redis,
    tmp_path: Path,
) -> None:
    # The case: a locked job scheduled more often than it takes.
    key = uuid.uuid4().hex[:10]
    entry = {"task": "b.once", "schedule": 0.25, "args": [key], "kwargs": {"seconds": 1.0}}
    prefix = app.conf.redsem_key_prefix
    with running_beat(redis_url, prefix, tmp_path, {"again": entry}, APP_MODULE) as (beat, log):

        def sends() -> int:
            return log.read_text(errors="replace").count("Sending due task again")

        wait_until(lambda: sends() >= 12 or beat.poll() is not None, 60, what="beat's sends")
        assert beat.poll() is None, log.read_text()
    sent, runs_then = sends(), _count(counter, app, "runs", key)
    wait_until(
        lambda: not counter.exists(_mark_key(app, f"once:{key}")), 20, what="the last run ended"
    )
    runs = _count(counter, app, "runs", key)
    assert runs <= runs_then + 1  # nothing piled up behind the runs
    assert 2 <= runs <= sent // 2
    assert _count(counter, app, "max", key) == 1


def test_a_limit_per_account_is_reached_exactly(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    big = f"big-{uuid.uuid4().hex[:6]}"  # any account but "small" gets 4
    burst = [app.tasks["b.plan"].delay(account, 0.4) for account in ["small", big] * 8]
    for result in burst:
        assert result.get(timeout=90) == "ran"
    assert _count(counter, app, "max", "small") == 2
    assert _count(counter, app, "max", big) == 4
