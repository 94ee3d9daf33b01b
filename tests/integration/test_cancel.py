"""A guarded run that Celery cancels (a lost broker connection with ``acks_late`` and
``worker_cancel_long_running_tasks_on_connection_loss``; a cold shutdown since Celery 5.6):
its request kills the pool child and frees the permit, however the installed Celery calls
``Request.cancel`` (``emit_retry`` only exists since 5.6: passing it to an older Celery raised
``TypeError`` and left the permit held).

A real prefork pool (billiard children) and the test server; the run's child is one of the
pool's, which the permit is held for as its body would.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.concurrency.prefork import TaskPool
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.request import Request

from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.integration.worker.request import install_request_class, set_pool
from tests.integration.conftest import holder
from tests.servers import wait_until


@pytest.fixture
def pool(app: Celery) -> Iterator[TaskPool]:
    """A started prefork pool of one child, as a worker of ``app`` makes it (and notes at
    ``worker_init``: an in-process threads worker of an earlier test noted its own)."""
    set_pool("prefork")
    started = TaskPool(limit=1, initargs=(app, "cancel-test"))
    started.start()
    try:
        yield started
    finally:
        started.terminate()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


#: The ways the installed Celery's consumer calls cancel (it took no ``emit_retry`` before 5.6).
CALLS: list[dict[str, Any]] = [{}]
if "emit_retry" in inspect.signature(Request.cancel).parameters:
    CALLS.append({"emit_retry": False})


@pytest.mark.parametrize("kwargs", CALLS, ids=lambda kwargs: ",".join(kwargs) or "pool")
def test_a_cancelled_run_is_killed_and_its_permit_freed(
    app: Celery, pool: TaskPool, key: str, kwargs: dict[str, Any]
) -> None:
    task = app.tasks["t.ignores_exit"]
    request_class = install_request_class(task)
    request = request_class(TaskMessage(task.name, args=[key]), app=app, task=task)
    sem = holder(app, f"stubborn:{key}")
    assert sem.acquire(permit_id=permit_id_of(request)) is not None  # as its body took it
    # The child runs a body when it is killed, as a cancelled run's child does. (An idle child
    # takes the pool's queue lock to poll for work: killed holding it, the pool's terminate
    # waited for that lock forever.)
    running = threading.Event()
    pool.apply_async(time.sleep, (30,), accept_callback=lambda *_: running.set())
    wait_until(running.is_set, 10, what="the child running a body")
    (child,) = pool.info["processes"]
    request.time_start, request.worker_pid = time.time(), child
    try:
        request.cancel(pool, **kwargs)
        wait_until(lambda: not _alive(child) or _zombie(child), 5, what="the child killed")
        assert sem.state().holders == []
    finally:
        sem.release(permit_id_of(request))
        if _alive(child) and not _zombie(child):
            os.kill(child, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` is dead but not reaped yet (the pool reaps its children in its loop)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False
