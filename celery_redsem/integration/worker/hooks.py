"""The worker's main process: free the permits of tasks whose child cannot, check Redis at start.

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
* ``task_revoked`` for a task revoked before it ran gives up its place in the waiting line.

Warm shutdown needs nothing: running tasks finish and release in the child; tasks parked by
:mod:`~celery_redsem.integration.admission.dispatcher` or waiting with a countdown keep their place
and
come back after redelivery.

At ``worker_init`` a worker with guarded tasks refuses to start, with one message, when no
Redis is set for the semaphores (or a setting is wrong): every guarded task would fail. (A
server that is set but unreachable is no reason: tasks retry until it answers.)
:func:`~celery_redsem.integration.admission.dispatcher.install_admission` hooks the worker's
dispatch
(``redsem_worker_admission``), and the :class:`StartChecks` bootstep is added to the app's
worker steps: it logs the start-up warnings (``acks_late``, task leases, Redis'
``maxmemory-policy``) once the worker's logging is set up.

``task_received`` lets a ``dedupe`` task's message take its mark as it arrives (see
:func:`~celery_redsem.integration.dedupe.sender.mark_received`).

**How the hooks are installed.** :func:`install_worker_hooks` connects the signal handlers,
once per process; the decorators call it as they make each guarded task. Not a bootstep
registered on the app up front: a decorator runs under ``@app.task`` before it knows the app
(and ``shared_task`` has none), so the signals, which every worker of the process sends, are
the one place reachable from there; the handlers then act only for an app with guarded tasks.
Importing this module connects nothing.
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
from celery import Celery, Task, bootsteps
from celery.concurrency import get_implementation
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.signals import task_received, task_revoked, worker_init
from celery.utils.imports import symbol_by_name
from celery.worker.request import Request

from celery_redsem.core.client import RedisClient
from celery_redsem.core.errors import (
    REDIS_ERRORS,
    BackendError,
    ConfigurationError,
    RedsemError,
    is_transient,
)
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.integration.admission.dispatcher import install_admission
from celery_redsem.integration.dedupe.sender import install_dedupe, mark_received
from celery_redsem.integration.guards.naming import call_arguments
from celery_redsem.integration.guards.rate_guard import iter_rate_limited_tasks
from celery_redsem.integration.guards.semaphore_guard import (
    TaskGuard,
    guards_of,
    iter_guarded_tasks,
)
from celery_redsem.integration.settings import (
    RedsemConfig,
    get_client,
    get_config,
    refresh_stall_warning,
)

__all__ = [
    "ReleasingRequest",
    "StartChecks",
    "check_eviction_policy",
    "check_late_acks",
    "install_request_class",
    "install_worker_hooks",
    "refuse_without_redis",
    "release_task",
    "start_warnings",
]

logger = logging.getLogger(__name__)

_WITH_TRACEBACK: Any = getattr(billiard.einfo, "ExceptionWithTraceback", ())
_CHILD_GONE = (WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)


def release_task(task: Task[Any, Any], request: Any) -> int:
    """Release every permit or place that the run ``request`` (a worker ``Request``) has for
    ``task``'s guards; how many."""
    guards = guards_of(task)
    task_id = request.id
    if not guards or not task_id:
        return 0
    permit_id = permit_id_of(request)
    call_args = call_arguments(task, request.args)
    released = 0
    for guard in guards:
        try:
            released += guard.release_by_id(
                task.app,
                task.name,
                call_args,
                dict(request.kwargs or {}),
                permit_id,
                task_id=task_id,
            )
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

    def cancel(self, pool: Any, signal: Any = None, emit_retry: bool = True) -> None:
        super().cancel(pool, signal, emit_retry)
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


_EVICTING = ("allkeys-", "volatile-")


def check_eviction_policy(client: RedisClient) -> str | None:
    """A warning if the server's ``maxmemory-policy`` could evict semaphore keys, or if it
    cannot be asked (not reachable, or refusing); None if all is well.

    Semaphore keys carry TTLs, so ``volatile-*`` policies can evict them as well as
    ``allkeys-*``. Read from ``INFO memory`` (which the documented ACL rule allows, unlike
    ``CONFIG GET``); on a cluster every node is checked.
    """
    try:
        reply = client.info("memory")
    except REDIS_ERRORS as exc:
        if is_transient(exc):
            return (
                f"celery_redsem: cannot reach the semaphores' Redis at worker start ({exc}); "
                "guarded tasks are retried until it answers (for up to redsem_max_wait)"
            )
        return (
            f"celery_redsem: the semaphores' Redis refused INFO at worker start ({exc}): "
            "its maxmemory-policy was not checked; if it refuses the scripts too, guarded "
            "tasks fail saying why"
        )
    per_node = reply.values() if "maxmemory_policy" not in reply else [reply]
    policies = {str(node.get("maxmemory_policy")) for node in per_node if isinstance(node, dict)}
    evicting = sorted(p for p in policies if p.startswith(_EVICTING))
    if evicting:
        return (
            f"celery_redsem: Redis maxmemory-policy is {evicting[0]!r}: under memory pressure the "
            "server may evict semaphore keys and let more tasks run than the limit allows; use "
            "'noeviction' (or a separate Redis for semaphores)"
        )
    return None


def check_late_acks(app: Celery, tasks: list[Task[Any, Any]]) -> str | None:
    """A warning if guarded tasks acknowledge late while a lost broker connection leaves them
    running (``worker_cancel_long_running_tasks_on_connection_loss`` off, Celery 5's default):
    the broker then delivers a running task again, maybe to another worker, and both copies
    run on the task id's one permit. None if nothing to say."""
    if app.conf.get("worker_cancel_long_running_tasks_on_connection_loss"):
        return None
    late = sorted(task.name for task in tasks if getattr(task, "acks_late", False))
    if not late:
        return None
    return (
        f"celery_redsem: guarded tasks with acks_late ({', '.join(late[:5])}"
        f"{', ...' if len(late) > 5 else ''}) keep running when the broker connection is "
        "lost, and the broker delivers them again: on another worker the two copies would "
        "share the task id's permit. Set worker_cancel_long_running_tasks_on_connection_loss"
        " = True (in Django settings: CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS)"
    )


def check_task_leases(
    config: RedsemConfig, guarded: list[tuple[Task[Any, Any], list[TaskGuard]]]
) -> list[str]:
    """A warning for each task (of ``guarded``: tasks with their guards) whose own ``lease=``
    is so short that one hung Redis call can outlast a heartbeat interval (``redsem_lease``
    is checked when the settings are read)."""
    warnings = []
    for task, guards in guarded:
        for guard in guards:
            if guard.lease is not None:
                warning = refresh_stall_warning(config, guard.lease, f"{task.name}'s lease")
                if warning:
                    warnings.append(warning)
    return warnings


class StartChecks(bootsteps.StartStopStep):
    """Logs celery_redsem's start-up warnings as the worker starts, once its logging is set up
    (``worker_init`` comes before that: a warning logged there has no time and no level)."""

    label = "celery_redsem checks"

    def start(self, parent: Any) -> None:
        for warning in start_warnings(parent.app):
            logger.warning(warning)


def start_warnings(app: Celery) -> list[str]:
    """What a worker of ``app`` should warn about at start: late acks, leases too short for
    the socket timeout, an eviction policy that could drop semaphore keys."""
    with_guards = list(iter_guarded_tasks(app))
    if not with_guards:
        return []
    config = get_config(app)
    warnings = [
        check_late_acks(app, [task for task, _guards in with_guards]),
        refresh_stall_warning(config, config.lease, "redsem_lease"),
        *check_task_leases(config, with_guards),
    ]
    if config.check_eviction_policy:
        try:
            warnings.append(check_eviction_policy(get_client(app)))
        except RedsemError as exc:  # a cluster client asks the cluster as it is built
            warnings.append(f"celery_redsem: cannot check Redis at worker start: {exc}")
    return [warning for warning in warnings if warning]


def refuse_without_redis(app: Celery, guarded: list[Task[Any, Any]]) -> None:
    """Stop a worker that has guarded tasks but no usable Redis setting, with one message
    (every guarded task would fail). An unreachable server is no reason: tasks retry."""
    try:
        get_config(app).require_redis_url()
        get_client(app)
    except ConfigurationError as exc:
        names = ", ".join(sorted(task.name for task in guarded)[:5])
        raise SystemExit(
            f"celery_redsem: this worker cannot run its guarded tasks ({names}"
            f"{', ...' if len(guarded) > 5 else ''}): {exc}"
        ) from None
    except BackendError:
        pass  # a cluster that cannot be reached now: StartChecks warns, tasks retry


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app: Celery | None = getattr(sender, "app", None)
    if app is None:
        return
    guarded = [task for task, _guards in iter_guarded_tasks(app)]
    # A worker whose only guarded tasks are rate limited needs admission (and Redis) too.
    guarded += [task for task in iter_rate_limited_tasks(app) if task not in guarded]
    if not guarded:
        return
    refuse_without_redis(app, guarded)
    global _pool_has_child_processes  # noqa: PLW0603
    _pool_has_child_processes = has_child_processes(getattr(sender, "pool_cls", None))
    for task in guarded:
        install_request_class(task)
    if get_config(app).worker_admission:
        install_admission(sender, app)
    install_dedupe(app)  # tasks this worker sends take their dedupe marks
    app.steps["worker"].add(StartChecks)  # before the worker builds its blueprint from them


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if terminated or request is None or not isinstance(sender, Task):
        return  # a terminated task is released in its child, or on Terminated
    release_task(sender, request)


def _on_task_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    if request is not None:
        mark_received(request)


_installed = False


def install_worker_hooks() -> None:
    """Connect the handlers of ``worker_init``, ``task_revoked`` and ``task_received`` (a
    ``dedupe`` task's message takes its mark as it arrives), once per process (later calls do
    nothing). The decorators call it for every guarded task they make."""
    global _installed  # noqa: PLW0603
    if _installed:
        return
    worker_init.connect(_on_worker_init, weak=False, dispatch_uid=f"{__name__}.on_worker_init")
    task_revoked.connect(_on_task_revoked, weak=False, dispatch_uid=f"{__name__}.on_task_revoked")
    task_received.connect(
        _on_task_received, weak=False, dispatch_uid=f"{__name__}.on_task_received"
    )
    _installed = True
