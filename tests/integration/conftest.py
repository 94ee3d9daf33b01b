"""Fixtures for the Celery integration: test apps, in-process and subprocess workers."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redsem import FairSemaphore, Permit, get_client
from celery_redsem.integration.settings import reset
from celery_redsem.integration.wire import GRANT_FIELD
from tests.integration.apps.tasks import make_app
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Celery's Redis result backend calls redis-py's ``setex``, which redis-py 8 deprecates.
_THIRD_PARTY_WARNINGS = ["ignore:Call to deprecated setex:DeprecationWarning"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            for spec in _THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))


def _delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=f"{prefix}:*", count=500):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture(scope="module")
def module_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix for one test module's apps, broker and results; deleted by SCAN afterwards."""
    value = f"redsemtest-{uuid.uuid4().hex[:12]}"
    yield value
    _delete_prefix(redis_url, value)


def close_app(app: Celery) -> None:
    """Close a test app without leaving a socket behind.

    AsyncResults in reference cycles unsubscribe (through the result backend's pub/sub
    connection) when collected; collect them while the app is open, then close that connection.
    """
    gc.collect()
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
    reset(app)  # and celery_redsem's client of it
    app.close()


@pytest.fixture(scope="module")
def app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    """The test app (tasks in tests/integration/apps/tasks.py), not the default app."""
    application = make_app(redis_url, module_prefix)
    yield application
    close_app(application)


@pytest.fixture(scope="module")
def worker(app: Celery) -> Iterator[object]:
    """An in-process worker (threads pool, 4 slots) consuming the test app's queue, without
    admission: it tests what a pool child does itself (asking, waiting in its slot, retrying
    through the broker), as on any worker where admission does not decide. Admission on every
    pool is tested through real workers (test_admission, test_pools)."""
    app.conf.redsem_worker_admission = False
    reset(app)
    try:
        with start_worker(
            app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=30
        ) as w:
            yield w
    finally:
        app.conf.redsem_worker_admission = True
        reset(app)


@pytest.fixture
def key() -> str:
    """A key no other test uses."""
    return uuid.uuid4().hex[:10]


def holder(app: Celery, name: str, limit: int = 1, lease: float = 30.0) -> FairSemaphore:
    """The semaphore ``name`` as the app's tasks see it, for holding it from the test."""
    return FairSemaphore(
        get_client(app), name, limit, lease=lease, prefix=app.conf.redsem_key_prefix
    )


def blocked(app: Celery, name: str) -> tuple[FairSemaphore, Permit]:
    """Hold the lock ``name`` from the test, so that the app's tasks on it have to wait."""
    sem = holder(app, name)
    blocker = sem.acquire()
    assert blocker is not None
    return sem, blocker


class WorkerProcess:
    """A real ``celery worker`` subprocess in its own process group."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        name: str,
        concurrency: int,
        log: Path,
        *extra: str,
        conf: dict[str, object] | None = None,
        app_module: str = "tests.integration.apps.worker_app",
        env: dict[str, str] | None = None,
        pool: str = "prefork",
    ) -> None:
        env = {
            **os.environ,
            **(env or {}),
            "REDSEM_TEST_APP_URL": redis_url,
            "REDSEM_TEST_APP_PREFIX": prefix,
            "REDSEM_TEST_APP_CONF": json.dumps(conf or {}),
            "PYTHONPATH": str(ROOT),
        }
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app_module,
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-n",
                f"{name}@%h",
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 60.0) -> None:
        wait_until(
            lambda: "ready." in self.log() or self.proc.poll() is not None,
            timeout,
            what="worker ready",
        )
        assert self.proc.poll() is None, self.log()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def begin_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM) without waiting for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Warm shutdown, then kill the whole process group whatever happens."""
        try:
            self.begin_stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self._log.close()


def forged_grant_runs_nothing(app: Celery, key: str) -> None:
    """A message header posing as a handed-over grant does not get a task past a held lock."""
    sem, blocker = blocked(app, f"locked:{key}")
    task_id = uuid.uuid4().hex
    forged = ["0" * 32, task_id, f"locked:{key}", app.conf.redsem_key_prefix, 1, 2**41, 0.0]
    result = app.tasks["t.locked"].apply_async(
        (key,), task_id=task_id, headers={GRANT_FIELD: forged}
    )
    wait_until(
        lambda: task_id in [w.permit_id for w in sem.state().waiters], 20, what="task in line"
    )
    assert not result.ready()
    assert [h.permit_id for h in sem.state().holders] == [blocker.id]
    sem.release(blocker)
    assert result.get(timeout=20)["token"] > blocker.token


def retried_run_waits_for_the_run_that_queued_it(app: Celery, key: str) -> None:
    """``self.retry()`` queues the next run (same task id) before the body ends: that run must
    not share the ending run's permit; the lock stays the ending run's until its release."""
    prefix = app.conf.redsem_key_prefix
    counter = redis.Redis.from_url(app.conf.broker_url)
    result = app.tasks["t.retries_inside"].delay(key)
    sem = holder(app, f"again:{key}")
    log_key = f"{prefix}:t:log:{key}"
    wait_until(  # the second run asked: it waits in line (or, wrongly, it runs already)
        lambda: (
            len(counter.lrange(log_key, 0, -1)) > 1
            or any(w.permit_id != result.id for w in sem.state().waiters)
        ),
        20,
        what="the retried run to ask for the lock",
    )
    counter.rpush(f"{prefix}:t:go:{key}", 1)
    out = result.get(timeout=30)
    log = [e.decode() for e in counter.lrange(log_key, 0, -1)]
    assert log == [f"start {result.id}", f"end {result.id}"] * 2
    assert int(counter.get(f"{prefix}:t:max:{key}") or 0) == 1
    assert out == {"retries": 1, "permit_id": f"{result.id}~1"}
    wait_until(lambda: sem.state().holders == [], 5, what="the lock freed")
    counter.close()


def kill_once_every_run_is_held(victim: WorkerProcess, survivor: WorkerProcess, runs: int) -> None:
    """SIGKILL ``victim`` (main process and children) once the two
    workers have received all ``runs`` runs, some of them the victim. (A "received" line comes
    once the broker counts the message as unacknowledged: one popped but not yet counted would
    die with the worker.)"""

    def delivered() -> bool:
        logs = victim.log().count("] received"), survivor.log().count("] received")
        return logs[0] > 0 and sum(logs) >= runs

    wait_until(delivered, 30, what="every run held by a worker, some by the victim")
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)


@contextlib.contextmanager
def running_workers(
    redis_url: str,
    prefix: str,
    logs: Path,
    names: list[str],
    concurrency: int,
    *extra: str,
    app_module: str = "tests.integration.apps.worker_app",
    pool: str = "prefork",
    **conf: object,
) -> Iterator[list[WorkerProcess]]:
    """Worker subprocesses named ``names``, ready; stopped (logs shown if asked) after.

    ``extra`` are more ``celery worker`` arguments (``"-Q", "queue"``), ``app_module`` the app
    they run, ``pool`` their pool (``-P``), ``conf`` app settings.
    ``REDSEM_TEST_SHOW_WORKER_LOGS=1`` prints their logs when they stop.
    """
    procs = [
        WorkerProcess(
            redis_url,
            prefix,
            name,
            concurrency,
            logs / f"{name}.log",
            *extra,
            conf=conf,
            app_module=app_module,
            pool=pool,
        )
        for name in names
    ]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:  # all shut down at once, then each is waited for
            proc.begin_stop()
        for proc in procs:
            proc.stop()
        if os.environ.get("REDSEM_TEST_SHOW_WORKER_LOGS"):
            for proc in procs:
                print(proc.log())


def true_in_forked_child(check: Callable[[], bool]) -> bool:
    """Run ``check`` in a forked child of this process and return what it found."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, b"1" if check() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return answer == b"1"


@contextlib.contextmanager
def running_beat(
    redis_url: str, prefix: str, tmp: Path, schedule: dict[str, object], app_module: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A real ``celery beat`` of the app of ``app_module`` with ``schedule``; stopped after."""
    log = tmp / "beat.log"
    env = {
        **os.environ,
        "REDSEM_TEST_APP_URL": redis_url,
        "REDSEM_TEST_APP_PREFIX": prefix,
        "REDSEM_TEST_APP_CONF": json.dumps(
            {"beat_schedule": schedule, "beat_max_loop_interval": 0.1}
        ),
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "celery", "-A", app_module, "beat", "-l", "INFO"]
    command += ["-s", str(tmp / "schedule")]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc, log
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
