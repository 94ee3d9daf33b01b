"""on_busy="skip"/"fail", dedupe at send time and limits per key (issue 21), on an in-process
worker (threads pool) and in eager mode; tests/integration/test_endings_workers.py has prefork
workers."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, group

from celery_redsem import (
    AlreadyQueued,
    Busy,
    ConfigurationError,
    KeyFunctionError,
    install_dedupe,
    with_lock,
    with_semaphore,
)
from celery_redsem.core.marks import DedupeMark
from celery_redsem.integration.dedupe.run_mark import RunMark, _keeper
from celery_redsem.integration.settings import get_config
from celery_redsem.signals import task_skipped
from tests.integration.apps.busy_tasks import close_busy_app, make_busy_app
from tests.integration.conftest import ROOT, blocked, holder
from tests.servers import wait_until


@pytest.fixture(scope="module")
def app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    application = make_busy_app(redis_url, module_prefix)
    yield application
    close_busy_app(application)


@pytest.fixture
def counter(app: Celery) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(app.conf.broker_url)
    yield client
    client.close()


@pytest.fixture
def skips() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append({"task": getattr(sender, "name", None), **kwargs})

    task_skipped.connect(receiver, weak=False)
    yield seen
    task_skipped.disconnect(receiver)


def _count(counter: redis.Redis, app: Celery, what: str, key: str) -> int:
    return int(counter.get(f"{app.conf.redsem_key_prefix}:b:{what}:{key}") or 0)


def _go(counter: redis.Redis, app: Celery, key: str) -> None:
    counter.rpush(f"{app.conf.redsem_key_prefix}:b:go:{key}", 1)


def test_skip_ends_runs_of_a_busy_key_without_their_bodies(
    app: Celery, worker: object, counter: redis.Redis, skips: list[dict[str, Any]]
) -> None:
    key = uuid.uuid4().hex[:10]
    first = app.tasks["b.skip"].delay(key, hold=True)
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 20, what="the first run")
    others = [app.tasks["b.skip"].delay(key) for _ in range(3)]
    assert [r.get(timeout=5) for r in others] == [None] * 3
    assert [r.state for r in others] == ["SUCCESS"] * 3
    assert _count(counter, app, "runs", key) == 1  # no body ran
    mine = [s for s in skips if s["task_id"] in {r.id for r in others}]
    assert {(s["reason"], s["name"], s["task"]) for s in mine} == {
        ("busy", f"skip:{key}", "b.skip")
    }
    assert len(mine) == 3
    _go(counter, app, key)
    assert first.get(timeout=20) == "ran"
    assert app.tasks["b.skip"].delay(key).get(timeout=20) == "ran"  # free again: it runs
    assert _count(counter, app, "runs", key) == 2


def test_fail_raises_busy_at_once_and_joins_no_line(app: Celery, worker: object) -> None:
    key = uuid.uuid4().hex[:10]
    sem, blocker = blocked(app, f"skip:{key}")
    result = app.tasks["b.fail"].delay(key)
    with pytest.raises(Busy, match="on_busy='fail'"):
        result.get(timeout=10)
    assert sem.state().waiters == []  # it never joined the line
    sem.release(blocker)
    assert app.tasks["b.fail"].delay(key).get(timeout=20) == "ran"


def test_eager_calls_skip_or_fail_too(app: Celery, counter: redis.Redis) -> None:
    key = uuid.uuid4().hex[:10]
    sem, blocker = blocked(app, f"skip:{key}")
    assert app.tasks["b.skip"].apply(args=(key,)).get() is None
    with pytest.raises(Busy):
        app.tasks["b.fail"].apply(args=(key,)).get()
    assert _count(counter, app, "runs", key) == 0
    sem.release(blocker)
    assert app.tasks["b.skip"].apply(args=(key,)).get() == "ran"


def test_max_wait_zero_names_on_busy_instead() -> None:
    def task(key: str) -> None: ...

    with pytest.raises(ConfigurationError, match="on_busy='skip'"):
        with_lock(key="k", max_wait=0)(task)
    with pytest.raises(ConfigurationError, match="on_busy of"):
        with_lock(key="k", on_busy="never")(task)
    with pytest.raises(ConfigurationError, match="dedupe of"):
        with_lock(key="k", dedupe="sometimes")(task)


def test_five_quick_sends_give_one_task_id_and_one_run(
    app: Celery, worker: object, counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    task = app.tasks["b.once"]
    results = [task.delay(key, hold=True) for _ in range(5)]
    assert len({r.id for r in results}) == 1
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 20, what="the run")
    assert task.apply_async((key,)).id == results[0].id  # while it runs, too
    _go(counter, app, key)
    assert results[0].get(timeout=20) == "ran"
    mark = DedupeMark(counter, f"once:{key}", prefix=app.conf.redsem_key_prefix)
    wait_until(lambda: mark.take("probe", 1) == "probe", 10, what="the mark cleared")
    mark.clear("probe")
    again = task.delay(key)  # the run ended: a send queues a new one
    assert again.id != results[0].id
    assert again.get(timeout=20) == "ran"
    assert _count(counter, app, "runs", key) == 2


def test_concurrent_sends_never_both_get_through(
    app: Celery, worker: object, counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    ids: list[str] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        ids.append(app.tasks["b.once"].delay(key, hold=True).id)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(set(ids)) == 1
    _go(counter, app, key)
    app.AsyncResult(ids[0]).get(timeout=20)
    assert _count(counter, app, "runs", key) == 1


def test_dedupe_raise_and_send_task_by_name(
    app: Celery, worker: object, counter: redis.Redis, skips: list[dict[str, Any]]
) -> None:
    key = uuid.uuid4().hex[:10]
    first = app.tasks["b.once_raise"].delay(key, hold=True)
    with pytest.raises(AlreadyQueued) as raised:
        app.tasks["b.once_raise"].delay(key)
    assert raised.value.task_id == first.id
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 20, what="the run")
    # By name the send cannot see the mark: the run finds it, and ends as a duplicate.
    by_name = app.send_task("b.once", (key,))
    assert by_name.get(timeout=20) is None
    assert [s["reason"] for s in skips if s["task_id"] == by_name.id] == ["duplicate"]
    _go(counter, app, key)
    assert first.get(timeout=20) == "ran"
    assert _count(counter, app, "runs", key) == 1


def test_a_revoked_run_frees_its_key(app: Celery, worker: object, counter: redis.Redis) -> None:
    key = uuid.uuid4().hex[:10]
    task = app.tasks["b.once"]
    later = task.apply_async((key,), countdown=1)  # queued, not running
    assert task.delay(key).id == later.id
    later.revoke()
    mark = DedupeMark(counter, f"once:{key}", prefix=app.conf.redsem_key_prefix)
    wait_until(lambda: mark.take("probe", 1) == "probe", 20, what="the mark cleared")
    mark.clear("probe")
    assert later.state == "REVOKED"
    assert _count(counter, app, "runs", key) == 0
    assert task.delay(key).get(timeout=20) == "ran"


def test_a_failed_run_clears_its_mark(app: Celery, worker: object, counter: redis.Redis) -> None:
    key = uuid.uuid4().hex[:10]
    failed = app.tasks["b.once"].delay(key, boom=True)
    with pytest.raises(RuntimeError, match="boom"):
        failed.get(timeout=20)
    mark_key = f"{app.conf.redsem_key_prefix}:{{once:{key}}}:dedupe"
    wait_until(lambda: not counter.exists(mark_key), 10, what="the mark cleared")
    assert app.tasks["b.once"].delay(key).get(timeout=20) == "ran"


def test_a_group_of_one_key_runs_once_and_completes(
    app: Celery, worker: object, counter: redis.Redis, skips: list[dict[str, Any]]
) -> None:
    key = uuid.uuid4().hex[:10]
    result = group(app.tasks["b.once"].si(key, hold=True) for _ in range(3)).apply_async()
    ids = {r.id for r in result.results}
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 20, what="the run")
    # The run goes on until the other two have ended as duplicates: one that reached the
    # worker only after it ended would find the key free, and run (a loaded host did that).
    wait_until(
        lambda: sorted(s["reason"] for s in skips if s["task_id"] in ids) == ["duplicate"] * 2,
        20,
        what="the two duplicates skipped",
    )
    _go(counter, app, key)
    assert sorted(result.get(timeout=20), key=str) == [None, None, "ran"]
    assert _count(counter, app, "runs", key) == 1


def test_a_running_mark_is_renewed_until_its_run_ends(app: Celery, counter: redis.Redis) -> None:
    config = dataclasses.replace(get_config(app), dedupe_lease=0.3)
    name = f"once:{uuid.uuid4().hex[:10]}"
    mark_key = f"{app.conf.redsem_key_prefix}:{{{name}}}:dedupe"
    run = RunMark(app, name, "run-1", config)
    run.hold("permit-1")
    started = time.monotonic()
    while time.monotonic() - started < 1.0:  # (an invariant over a span of time)
        assert counter.hget(mark_key, "id") == b"run-1"
        assert 0 < counter.pttl(mark_key) <= 300
        time.sleep(0.05)
    run.end()
    assert not counter.exists(mark_key)
    wait_until(lambda: len(_keeper) == 0, 5, what="the keeper to let go")


def test_eager_dedupe_runs_and_clears(app: Celery, counter: redis.Redis) -> None:
    key = uuid.uuid4().hex[:10]
    mark_key = f"{app.conf.redsem_key_prefix}:{{once:{key}}}:dedupe"
    app.conf.task_always_eager = True
    try:
        assert app.tasks["b.once"].delay(key).get() == "ran"
        assert app.tasks["b.once"].delay(key).get() == "ran"
        with pytest.raises(RuntimeError, match="boom"):
            app.tasks["b.once"].delay(key, boom=True).get()
        assert not counter.exists(mark_key)
    finally:
        app.conf.task_always_eager = False
    assert _count(counter, app, "runs", key) == 2


def test_a_limit_per_key_is_reached_and_never_exceeded(
    app: Celery, worker: object, counter: redis.Redis
) -> None:
    # Four threads (conftest's worker): one account at a time; test_endings_workers has both.
    for account, limit in (("small", 2), ("big", 4)):
        burst = [app.tasks["b.plan"].delay(account) for _ in range(8)]
        assert [r.get(timeout=60) for r in burst] == ["ran"] * 8
        assert _count(counter, app, "max", account) == limit


def test_a_changed_limit_applies_to_new_grants_and_holders_keep_theirs(app: Celery) -> None:
    # What a limit function's new answer does (a customer's plan downgraded from 3 to 1).
    name = f"plan:{uuid.uuid4().hex[:10]}"
    before = holder(app, name, limit=3)
    held = [before.acquire() for _ in range(3)]
    assert all(held)
    after = holder(app, name, limit=1)
    assert after.acquire() is None
    assert {h.permit_id for h in after.state().holders} == {p.id for p in held if p}
    for permit in held[:2]:
        assert permit is not None
        before.release(permit)
    assert after.acquire() is None  # one holder left: the new limit is reached
    assert held[2] is not None
    before.release(held[2])
    granted = after.acquire()
    assert granted is not None
    assert after.acquire() is None
    after.release(granted)


@pytest.mark.parametrize(
    ("limit", "args", "fragment"),
    [
        (lambda account: 0, ("a",), "returned 0"),
        (lambda account: "3", ("a",), "returned '3'"),
        (lambda account: 1 / 0, ("a",), "raised ZeroDivisionError"),
    ],
)
def test_a_bad_limit_function_fails_the_call_saying_so(
    app: Celery, limit: Any, args: tuple[Any, ...], fragment: str
) -> None:
    def task(account: str) -> str:
        return "ran"

    guarded = with_semaphore(limit=limit, key="k")(task)
    with pytest.raises(KeyFunctionError, match=rf"limit function .* {re.escape(fragment)}"):
        guarded(*args)


def test_a_limit_function_is_checked_at_decoration() -> None:
    def task(account: str) -> None: ...

    with pytest.raises(ConfigurationError, match=r"limit function .* asks for 'acount'"):
        with_semaphore(limit=lambda acount: 1, key="k")(task)


SENDER = """
import json
from celery_redsem import AlreadyQueued
from tests.integration.apps.sender_tasks import app, build, build_or_raise

ids = [build.delay("r1").id for _ in range(5)]
raised = 0
for _ in range(3):
    try:
        build_or_raise.delay("r2")
    except AlreadyQueued:
        raised += 1
print(json.dumps({"ids": ids, "raised": raised, "finalized": app.finalized}))
"""


def test_a_process_that_only_imports_the_tasks_and_sends_takes_the_marks(
    redis_url: str, module_prefix: str
) -> None:
    # A web handler's process: it imports the tasks module and calls .delay(); its app is never
    # finalized. Five sends of one key queue one run; "raise" raises for the repeats.
    env = {
        **os.environ,
        "REDSEM_TEST_APP_URL": redis_url,
        "REDSEM_TEST_APP_PREFIX": f"{module_prefix}-senders",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", SENDER], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["finalized"] is False
    assert len(set(out["ids"])) == 1
    assert out["raised"] == 3 - 1


def test_install_dedupe_on_an_app_not_finalized_counts_the_tasks_that_take_marks() -> None:
    # (It returned 0 for an app not finalized yet, though it had turned dedupe on.)
    app = Celery("install-dedupe", set_as_current=False)

    @app.task(name="d.one")
    @with_lock(key=lambda n: n, dedupe=True)
    def one(n: str) -> None: ...

    @app.task(name="d.two")
    @with_lock(key=lambda n: n, dedupe="raise")
    def two(n: str) -> None: ...

    @app.task(name="d.guarded")
    @with_lock(key=lambda n: n)
    def guarded(n: str) -> None: ...

    @app.task(name="d.plain")
    def plain(n: str) -> None: ...

    assert not app.finalized
    assert install_dedupe(app) == 2
