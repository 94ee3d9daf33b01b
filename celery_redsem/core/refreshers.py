"""The threads a heartbeat's refresh calls run on: a few OS threads, started on demand.

One client stuck on a hung or black-holed server ties up one thread; the permits on other
clients go on being refreshed on time (:mod:`~celery_redsem.core.heartbeat`). The threads and
the queue they wait on are the OS's, also in a gevent or eventlet process
(:mod:`~celery_redsem.core.native`).
"""

from __future__ import annotations

import _queue
import logging
from collections.abc import Callable
from typing import Any

from celery_redsem.core import native

__all__ = ["Refreshers"]

logger = logging.getLogger(__name__)

#: Seconds an idle refresher thread waits for work before it ends.
_REFRESHER_IDLE = 10.0


class Refreshers:
    """Daemon (OS) threads that run refresh calls: at most ``limit``, started when a call finds
    none idle, each ending after :data:`_REFRESHER_IDLE` seconds without work."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = native.allocate_lock()
        self._jobs: Any = _queue.SimpleQueue()  # (C-level: an OS thread waits on it, never green)
        self._pending = 0  # jobs put and not taken yet
        self._threads = 0
        self._idle = 0

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on an idle thread, a new one, or (all ``limit`` busy) the next free."""
        with self._lock:
            self._pending += 1
            self._jobs.put(job)
            start = self._idle < self._pending and self._threads < self._limit
            if start:
                self._threads += 1
        if start:
            native.start_thread(self._serve, "redsem-refresh")

    def end_idle(self) -> None:
        """Let the idle threads end now."""
        with self._lock:
            for _ in range(self._idle):
                self._jobs.put(_END)

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=_REFRESHER_IDLE)
            except _queue.Empty:
                job = _END
            with self._lock:
                self._idle -= 1
                if job is _END:
                    if self._pending <= self._idle:  # (else work came: stay for it)
                        self._threads -= 1
                        return
                    continue
                self._pending -= 1
            try:
                job()
            except Exception:  # the thread must survive anything; the next beat retries
                native.in_green(logger.exception, "celery_redsem: refreshing permits failed")
            del job


def _end() -> None:
    """What tells an idle refresher thread to end."""


_END = _end
