"""A worker's start log shows a bad ``redsem_redis_options`` without its password."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redsem import with_lock
from tests.integration.conftest import WorkerProcess, close_app
from tests.servers import wait_until

PASSWORD = "S3cr3t-7Qx"
OPTIONS = {"password": PASSWORD, "socket_timeout": "5"}  # a str, as read from the environment


def _guarded_app(redis_url: str) -> Celery:
    app = Celery("redsem-secret-worker", broker="memory://", set_as_current=False)
    app.conf.update(redsem_redis_url=redis_url, redsem_redis_options=OPTIONS)

    @app.task(name="t.secret_guarded")
    @with_lock(key="secret")
    def guarded() -> None:
        """A guarded task, so that the worker reads the settings at start."""

    return app


def test_the_start_log_of_an_in_process_worker(redis_url, caplog):
    caplog.set_level(logging.DEBUG)
    app = _guarded_app(redis_url)
    shown: list[str] = []
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            pass
    except (Exception, SystemExit) as exc:  # a worker may refuse to start on a bad setting
        shown += [str(exc), repr(exc)]
    finally:
        close_app(app)
    shown.append(caplog.text)
    assert any("redsem_redis_options" in text and "***" in text for text in shown), shown
    assert [text for text in shown if PASSWORD in text] == []


@pytest.mark.slow
def test_the_start_log_of_a_worker_subprocess(redis_url, tmp_path: Path):
    proc = WorkerProcess(
        redis_url,
        f"redsemtest-{uuid.uuid4().hex[:12]}",
        "secrets",
        1,
        tmp_path / "worker.log",
        conf={"redsem_redis_options": OPTIONS},
    )
    try:
        wait_until(
            lambda: "redsem_redis_options" in proc.log() or not proc.alive(),
            60,
            what="the worker to report the bad setting",
        )
    finally:
        proc.stop()
    log = proc.log()
    assert "redsem_redis_options" in log, log
    assert "'password': '***'" in log
    assert PASSWORD not in log
