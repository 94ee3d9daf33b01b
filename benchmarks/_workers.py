"""Real ``celery worker`` subprocesses for the Celery benchmarks: started in sessions of their
own (a signal to the process group reaches the pool children), waited for, and stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from celery import Celery

__all__ = ["ROOT", "start_workers", "stop_workers", "wait_workers_ready"]

#: The repository's root: the workers' working directory, on their ``PYTHONPATH``.
ROOT = Path(__file__).resolve().parents[1]


def start_workers(
    app_module: str,
    environ: Mapping[str, str],
    names: list[str],
    concurrency: int,
    pool: str = "prefork",
) -> list[subprocess.Popen[bytes]]:
    """A worker ``-P pool -c concurrency`` of ``celery -A app_module`` per node name of
    ``names`` (``<name>@<host>``), with ``environ`` added to this process's environment; their
    output is dropped. They send no events (``--without-heartbeat --without-gossip``): on
    gevent and eventlet with RabbitMQ, Celery's loop would wait 0.1 s on the event connection
    after every message (see docs/pools.rst)."""
    env = {**os.environ, **environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "celery", "-A", app_module, "worker"]
    options = ["-P", pool, "-c", str(concurrency), "-l", "WARNING", "--without-gossip"]
    options.append("--without-heartbeat")
    return [
        subprocess.Popen(
            [*command, *options, "--without-mingle", "-n", f"{name}@%h"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for name in names
    ]


def stop_workers(procs: list[subprocess.Popen[bytes]], grace: float = 15.0) -> None:
    """SIGTERM each worker, give them ``grace`` seconds in all to stop, then SIGKILL whatever
    is left of each one's process group."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_workers_ready(app: Celery, count: int, timeout: float = 60.0) -> None:
    """Return once ``count`` workers answer a ping (RuntimeError after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(app.control.ping(timeout=0.5) or []) >= count:
            return
    raise RuntimeError(f"{count} workers did not come up within {timeout}s")
