"""on_busy, dedupe and per-key limits (issue 21) with real ``celery worker`` prefork
subprocesses: admission at dispatch on (the default), two workers of four slots."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from tests.celery.busy_tasks import make_busy_app
from tests.celery.conftest import WorkerProcess, close_app, running_workers
from tests.servers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    application = make_busy_app(redis_url, module_prefix)
    yield application
    close_app(application)


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
        app_module="tests.celery.busy_worker_app",
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


def test_skip_while_a_run_holds_the_lock(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    first = app.tasks["b.skip"].delay(key, hold=True)
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 30, what="the first run")
    others = [app.tasks["b.skip"].delay(key) for _ in range(3)]
    assert [r.get(timeout=5) for r in others] == [None] * 3  # within a few seconds
    assert [r.state for r in others] == ["SUCCESS"] * 3
    assert _count(counter, app, "runs", key) == 1
    assert any(f"[{others[0].id}] skipped" in proc.log() for proc in workers)
    _go(counter, app, key)
    assert first.get(timeout=20) == "ran"
    assert app.tasks["b.skip"].delay(key).get(timeout=20) == "ran"
    assert _count(counter, app, "runs", key) == 2


def test_five_quick_sends_one_run_then_a_new_one(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    key = uuid.uuid4().hex[:10]
    task = app.tasks["b.once"]
    results = [task.delay(key, hold=True) for _ in range(5)]
    assert len({r.id for r in results}) == 1
    wait_until(lambda: _count(counter, app, "runs", key) == 1, 30, what="the run")
    _go(counter, app, key)
    assert results[0].get(timeout=20) == "ran"
    again = task.delay(key)  # the run cleared its mark as it ended: a new one is queued
    assert again.id != results[0].id
    assert again.get(timeout=20) == "ran"
    assert _count(counter, app, "runs", key) == 2


def test_a_limit_per_account_is_reached_exactly(
    app: Celery, workers: list[WorkerProcess], counter: redis.Redis
) -> None:
    big = f"big-{uuid.uuid4().hex[:6]}"  # any account but "small" gets 4
    burst = [app.tasks["b.plan"].delay(account, 0.4) for account in ["small", big] * 8]
    for result in burst:
        assert result.get(timeout=90) == "ran"
    assert _count(counter, app, "max", "small") == 2
    assert _count(counter, app, "max", big) == 4
