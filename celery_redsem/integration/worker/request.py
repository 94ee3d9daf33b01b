"""The request class of a guarded task: it frees the permit when the pool child cannot.

A pool child releases its permit in a ``finally``. When the child cannot (it was killed by a
hard time limit, ``revoke(terminate=True)``, a cold shutdown or ``SIGKILL``), the main process
releases by task id, which frees whatever grant or place in line the id has:

* At ``worker_init`` every guarded task gets a :class:`ReleasingRequest` subclass of its
  ``Request`` class (Celery's documented extension point). It releases when the child is gone
  (``WorkerLostError``, ``Terminated``: the pool has reaped it) *before* Celery may requeue the
  message. Where the pool is about to kill a live child (hard time limit, cold shutdown) it
  kills it first (``SIGKILL``), then releases: a permit is never free while its body can still
  run. ``revoke(terminate=True)`` only signals the child; a child that survives the signal
  (say ``SIGUSR1``, a soft time limit) releases in its own ``finally``, one that dies is
  released on ``Terminated``.
* :func:`release_task` also serves ``task_revoked`` for a task revoked before it ran: it gives
  up its place in the waiting line.

The request also lets admission hold its acknowledgement back while it is a standby.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from contextlib import suppress
from typing import Any

import billiard.einfo
from billiard.einfo import ExceptionInfo
from celery import Task
from celery.concurrency import get_implementation
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.utils.imports import symbol_by_name
from celery.worker.request import Request

from celery_redsem.core.errors import RedsemError
from celery_redsem.integration.guards.base import guards_of

__all__ = [
    "ReleasingRequest",
    "has_child_processes",
    "install_request_class",
    "release_task",
    "set_pool",
]

logger = logging.getLogger(__name__)

_WITH_TRACEBACK: Any = getattr(billiard.einfo, "ExceptionWithTraceback", ())
_CHILD_GONE = (WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)


def release_task(task: Task[Any, Any], request: Any) -> int:
    """Release every permit or place that the run ``request`` (a worker ``Request``) has for
    ``task``'s guards; how many."""
    task_id = request.id
    if not task_id:
        return 0
    released = 0
    for guard in guards_of(task):
        try:
            released += guard.release_run(task, request)
        except RedsemError as exc:
            logger.warning("celery_redsem: could not release %s[%s]: %s", task.name, task_id, exc)
    if released:
        logger.info(
            "celery_redsem: released the permit of %s[%s] for its lost child", task.name, task_id
        )
    return released


class ReleasingRequest(Request):
    """A worker request that frees its task's permit when the pool child cannot (and whose
    acknowledgement admission can hold back while it is a standby)."""

    _redsem_released = False
    _redsem_ack_held = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: When this delivery reached the worker (monotonic): admission parks it for at most
        #: :data:`~celery_redsem.integration.admission.parking.MAX_PARKED` from then (the broker's
        #: clock
        #: runs too).
        self.redsem_received_at = time.monotonic()

    def acknowledge(self) -> None:
        if not self._redsem_ack_held:
            super().acknowledge()

    def redsem_hold_ack(self) -> None:
        """Hold the acknowledgement back (a standby's: until its child gets its permit)."""
        self._redsem_ack_held = True

    def redsem_ack(self) -> None:
        """Acknowledge now if the acknowledgement was held back and nothing else did it."""
        if self._redsem_ack_held:
            self._redsem_ack_held = False
            super().acknowledge()

    def _redsem_release(self) -> None:
        """Release by task id, once per request: a second time (several of the handlers below
        may see one end) could free the grant of a redelivered copy that runs elsewhere."""
        task = self.task
        if task is not None and not self._redsem_released:
            self._redsem_released = True
            release_task(task, self)

    def _redsem_kill_child(self) -> bool:
        """SIGKILL the child process running this task (the pool is about to): True if there
        was one, and its permit is to be freed next. Other pools run the task in this process
        (``worker_pid`` is a greenlet's or thread's id there), where its ``finally`` releases."""
        pid = self.worker_pid
        if not _pool_has_child_processes or not pid or int(pid) == os.getpid():
            return False
        with suppress(ProcessLookupError, PermissionError, OverflowError):
            os.kill(int(pid), signal.SIGKILL)
        return True

    def on_failure(
        self, exc_info: ExceptionInfo, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        exc = exc_info.exception
        if isinstance(exc, _WITH_TRACEBACK):
            exc = exc.exc
        if isinstance(exc, TimeLimitExceeded):  # hard limit: the child is still alive
            if self._redsem_kill_child():
                self._redsem_release()
        elif isinstance(exc, _CHILD_GONE):
            self._redsem_release()  # before super(): it may requeue the message
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft and self._redsem_kill_child():
            self._redsem_release()
        super().on_timeout(soft, timeout)

    def cancel(self, pool: Any, *args: Any, **kwargs: Any) -> None:
        # Celery's own arguments, whatever its version takes (``emit_retry`` since 5.6).
        super().cancel(pool, *args, **kwargs)
        # Cold shutdown: the worker may exit before the child is reaped.
        if self.time_start and self._redsem_kill_child():
            self._redsem_release()


#: Whether this worker's pool runs tasks in child processes (set at ``worker_init``).
_pool_has_child_processes = True


def has_child_processes(pool_cls: Any) -> bool:
    """Whether a worker pool (a ``-P`` name such as ``"prefork"``, or a class) runs tasks in
    child processes, which the main process can kill. Unknown: True, as the default pool."""
    if pool_cls is None:
        return True
    try:
        cls = get_implementation(pool_cls)
    except Exception:  # a pool that cannot be imported here: assume the default
        return True
    return isinstance(cls, type) and issubclass(cls, PreforkPool)


def install_request_class(task: Task[Any, Any]) -> type[Request]:
    """Give ``task`` a :class:`ReleasingRequest` built on its current ``Request`` class."""
    base: type[Request] = symbol_by_name(task.Request)
    if issubclass(base, ReleasingRequest):
        return base
    if base is Request:
        cls: type[Request] = ReleasingRequest
    else:
        cls = type(f"Releasing{base.__name__}", (ReleasingRequest, base), {"__module__": __name__})
    setattr(task, "Request", cls)  # noqa: B010 (the stubs type Request as a str)
    return cls


def set_pool(pool_cls: Any) -> None:
    """Note the worker's pool (at ``worker_init``): whether its tasks run in child processes."""
    global _pool_has_child_processes  # noqa: PLW0603
    _pool_has_child_processes = has_child_processes(pool_cls)
