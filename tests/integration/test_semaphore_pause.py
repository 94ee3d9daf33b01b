"""Pausing a semaphore's key under Celery (issue 41) through real prefork workers: from the
body (``pause_and_retry``), by the CLI (``pause``/``resume``), and a worker SIGKILLed while
the key is paused. No run starts while its key is paused, none fails, none is lost; other keys
run on."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redsem import FairSemaphore
from tests.integration.apps.budget_tasks import SEM_PAUSE
from tests.integration.apps.rate_tasks import make_rate_app, read_starts
from tests.integration.conftest import (
    close_app,
    kill_once_every_run_is_held,
    running_workers,
)
from tests.integration.test_backlog import _quick_redelivery
from tests.servers import wait_until
from tests.test_cli import run


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def prefork_app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    """The app of the two prefork workers, under a prefix of its own."""
    application = make_rate_app(redis_url, f"{module_prefix}-sem-pause")
    yield application
    close_app(application)


@pytest.fixture(scope="module")
def workers(redis_url: str, prefork_app: Celery, tmp_path_factory: Any) -> Iterator[None]:
    """Two real prefork workers, ``-c 4`` each, running the ``r.*`` tasks of ``prefork_app``."""
    logs: Path = tmp_path_factory.mktemp("sem-pause-workers")
    prefix, module = prefork_app.conf.redsem_key_prefix, "tests.integration.apps.rate_worker_app"
    with running_workers(redis_url, prefix, logs, ["pa", "pb"], 4, app_module=module):
        yield


def _paused(client: redis.Redis, prefix: str, name: str) -> float:
    """Seconds the name stays paused (its pause key's TTL)."""
    return max(0, int(client.pttl(f"{prefix}:{{{name}}}:pause"))) / 1000


@pytest.mark.slow
def test_a_pause_from_a_semaphore_body_holds_the_key_on_every_worker(
    prefork_app: Celery, workers: None, client: redis.Redis
) -> None:
    """Run 0 holds the only permit and pauses its key (as after HTTP 429): its permit goes
    back, yet no run starts on either worker until the pause ends; then all run, run 0 again,
    none failing (max_retries=0); another key runs meanwhile."""
    key, prefix = uuid.uuid4().hex[:10], prefork_app.conf.redsem_key_prefix
    first = prefork_app.tasks["r.sem_call"].delay(key, 0)
    wait_until(lambda: client.exists(f"{prefix}:r:sem429:{key}"), 30, what="run 0's pause")
    sent = [prefork_app.tasks["r.sem_call"].delay(key, n) for n in range(1, 8)]
    other_key = f"o{key}"
    other = [prefork_app.tasks["r.sem_free"].delay(other_key, n) for n in range(3)]
    assert [r.get(timeout=60) for r in other] == [0, 1, 2]
    assert first.get(timeout=60) == 0
    assert [r.get(timeout=60) for r in sent] == list(range(1, 8))
    paused_at = int(client.get(f"{prefix}:r:sem429:{key}") or 0) / 1e6
    starts = read_starts(client, prefix, key)
    assert sorted(s.n for s in starts) == [0, 0, 1, 2, 3, 4, 5, 6, 7]  # run 0 twice
    assert {s.retries for s in starts} == {0}
    inside = [s for s in starts if paused_at + 0.01 < s.at < paused_at + SEM_PAUSE - 0.01]
    assert inside == [], f"started {[round(s.at - paused_at, 3) for s in inside]}s into it"
    assert max(s.at for s in starts if s.n == 0) >= paused_at + SEM_PAUSE - 0.01
    other_starts = read_starts(client, prefix, other_key)
    assert other_starts[0].at < paused_at + SEM_PAUSE - 0.5, "another key was held by the pause"


@pytest.mark.slow
def test_the_cli_pauses_and_resumes_a_semaphore_across_workers(
    prefork_app: Celery, workers: None, client: redis.Redis
) -> None:
    """``celery redsem pause NAME 60`` holds every run of a semaphore key on both workers
    (on_busy="fail", max_wait=1: paused is not busy, and the pause does not count toward
    max_wait); ``resume`` lets them all run, none failing."""
    key, prefix = uuid.uuid4().hex[:10], prefork_app.conf.redsem_key_prefix
    name = f"sfree:{key}"
    assert run(prefork_app, "pause", name, "60").exit_code == 0
    sent = [prefork_app.tasks["r.sem_free"].delay(key, n) for n in range(6)]
    deadline = time.monotonic() + 2.0  # none may start while it is paused (past max_wait)
    while time.monotonic() < deadline:
        assert read_starts(client, prefix, key) == [], "a run started while its key was paused"
        assert not any(r.failed() for r in sent)
        time.sleep(0.05)
    assert 55 < _paused(client, prefix, name) <= 60
    assert "PAUSED" in run(prefork_app, "status", name).output
    resumed_at = time.time()
    assert run(prefork_app, "resume", name).exit_code == 0
    assert [r.get(timeout=60) for r in sent] == list(range(6))
    starts = read_starts(client, prefix, key)
    assert {s.retries for s in starts} == {0}
    assert min(s.at for s in starts) >= resumed_at - 1  # (one machine's clocks)


@pytest.mark.slow
def test_a_worker_killed_while_its_semaphore_is_paused_loses_no_run(
    redis_url: str, prefork_app: Celery, client: redis.Redis, tmp_path: Path
) -> None:
    """Two workers hold parked runs of a paused semaphore key; one is SIGKILLed. Its runs
    (never acknowledged) come back to the other, and every run starts once, after the pause."""
    key, prefix = uuid.uuid4().hex[:10], prefork_app.conf.redsem_key_prefix
    name, queue, pause = f"swait:{key}", f"skill-{key}", 12.0
    # The broker gives a dead worker's unacknowledged messages back within seconds.
    options = _quick_redelivery(prefix)
    module = "tests.integration.apps.rate_worker_app"
    with running_workers(
        redis_url, prefix, tmp_path, ["sv", "ss"], 2, "-Q", queue, app_module=module,
        broker_transport_options=options,
    ) as (victim, survivor):  # fmt: skip
        paused_at = time.time()
        assert FairSemaphore(client, name, 100, prefix=prefix).pause(pause) == pause
        sent = [
            prefork_app.tasks["r.sem_wait"].apply_async((key, n), queue=queue) for n in range(12)
        ]

        kill_once_every_run_is_held(victim, survivor, len(sent))
        assert _paused(client, prefix, name) > 0, "the pause ended before the kill"
        assert read_starts(client, prefix, key) == []
        assert [r.get(timeout=90) for r in sent] == list(range(12))
        assert survivor.alive()
    starts = read_starts(client, prefix, key)
    assert sorted(s.n for s in starts) == list(range(12)), "a run was lost or ran twice"
    assert {s.retries for s in starts} == {0}
    assert min(s.at for s in starts) >= paused_at + pause - 0.05
