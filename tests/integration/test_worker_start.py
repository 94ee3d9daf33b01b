"""Real prefork workers at start and under a key function that exits: refuse to start without
Redis, warn with the worker's logging, never die of a task's key function."""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from kombu import Connection

from celery_redsem import KeyFunctionError
from tests.integration.conftest import WorkerProcess
from tests.servers import free_port, wait_until

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _worker(
    redis_url: str, prefix: str, logs: Path, queue: str, **conf: object
) -> Iterator[WorkerProcess]:
    """A one-slot prefork worker consuming ``queue`` only, with app settings ``conf``;
    stopped afterwards."""
    proc = WorkerProcess(redis_url, prefix, queue, 1, logs / "w.log", "-Q", queue, conf=conf)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("admission", [True, False])
def test_a_key_function_that_exits_fails_its_task_not_the_worker(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, admission: bool
) -> None:
    # With admission the key function runs in the worker's main process first, else only in
    # the pool child: either way SystemExit / KeyboardInterrupt fail that task, visibly.
    queue = f"exits-{admission}"
    with _worker(
        redis_url, module_prefix, tmp_path, queue, redsem_worker_admission=admission
    ) as proc:
        proc.wait_ready()
        bad_key = app.tasks["t.bad_key"]
        for mode, fragment in [("exit", "SystemExit(3)"), ("interrupt", "KeyboardInterrupt()")]:
            result = bad_key.apply_async((mode,), queue=queue)
            wait_until(
                lambda result=result: result.ready() or not proc.alive(),
                30,
                what=f"the task whose key function raises {fragment} to end",
            )
            assert proc.alive(), f"the key function's {fragment} stopped the worker:\n{proc.log()}"
            with pytest.raises(KeyFunctionError, match=re.escape(fragment)):
                result.get(timeout=5)
        assert bad_key.apply_async(("good",), queue=queue).get(timeout=30) == "ran"
        assert proc.alive(), proc.log()


def test_a_worker_without_a_redis_setting_refuses_to_start_with_one_message(
    redis_url: str, module_prefix: str, tmp_path: Path
) -> None:
    # Neither redsem_redis_url nor a redis:// result backend or broker: every guarded task
    # would fail, so the worker does not start.
    no_redis = {"broker_url": "memory://", "result_backend": None}
    with _worker(redis_url, module_prefix, tmp_path, "noredis", **no_redis) as proc:
        wait_until(lambda: not proc.alive(), 60, what="the worker to exit")
        log = proc.log()
        assert proc.proc.returncode != 0, log
        assert "ready." not in log
        assert "Traceback" not in log, log
        (line,) = [line for line in log.splitlines() if "celery_redsem" in line]
        assert line.startswith("celery_redsem: this worker cannot run its guarded tasks (")
        assert "set redsem_redis_url" in line
        assert "celery_redsem: celery_redsem" not in log


def test_an_unreachable_redis_starts_and_warnings_are_logged_with_a_level(
    redis_url: str, module_prefix: str, tmp_path: Path
) -> None:
    # A configured server that does not answer is no reason to refuse: tasks retry. The start
    # warnings go through the worker's logging (time and level), not bare to stderr; so do
    # those about a misspelled setting, read before the worker's logging is set up.
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    conf = {"redsem_redis_url": unreachable, "task_acks_late": True, "redsem_leas": 5}
    with _worker(redis_url, module_prefix, tmp_path, "unreachable", **conf) as proc:
        proc.wait_ready()
        log = proc.log()
        assert "WARNING/MainProcess] celery_redsem: guarded tasks with acks_late" in log, log
        assert "WARNING/MainProcess] celery_redsem: cannot reach the semaphores' Redis" in log
        (typo,) = [line for line in log.splitlines() if "redsem_leas " in line]
        assert typo.endswith(
            "WARNING/MainProcess] celery_redsem: redsem_leas is not a celery_redsem setting "
            "and is ignored; did you mean redsem_lease?"
        ), log


RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def _rabbitmq_answers() -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5672), timeout=1):
        return True
    return False


@pytest.mark.skipif(not _rabbitmq_answers(), reason="no RabbitMQ at 127.0.0.1:5672")
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_worker_on_rabbitmq_is_told_of_celerys_event_drain_unless_heartbeats_are_off(
    redis_url: str, module_prefix: str, tmp_path: Path, pool: str
) -> None:
    # Celery's loop on gevent and eventlet waits 0.1 s on the event connection after every
    # message when it sends events with broker heartbeats on: about 10 messages a second,
    # guarded or not (plain Celery 5.7 here: 100 tasks of 20 ms took 10.1 s). Said once at
    # start, naming the settings that avoid it; not said where they are set.
    warning = "reads at most about 10 messages a second from RabbitMQ"
    queue = f"green-events-{pool}-{module_prefix}"
    logs = {}
    for label, conf in (("on", {}), ("off", {"broker_heartbeat": 0})):
        log = tmp_path / f"{label}.log"
        proc = WorkerProcess(
            redis_url,
            module_prefix,
            f"{label}-{queue}",
            2,
            log,
            "-Q",
            queue,
            "-E",  # (the test workers start --without-heartbeat: events, as -E sends them)
            conf={"broker_url": RABBITMQ, **conf},
            pool=pool,
        )
        try:
            proc.wait_ready()
            logs[label] = proc.log()
        finally:
            proc.stop()
    assert logs["on"].count(warning) == 1, logs["on"]
    assert "broker_heartbeat = 0" in logs["on"]
    assert warning not in logs["off"], logs["off"]
    with Connection(RABBITMQ) as connection:
        connection.default_channel.queue_delete(queue)
