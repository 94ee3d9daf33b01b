"""``@with_semaphore`` and ``@with_lock``: the decorators a task author writes under ``@app.task``.

::

    @app.task(bind=True)
    @with_semaphore(limit=5, key=lambda account_id: f"market:{account_id}")
    def buy_item(self, account_id, item_id): ...

    @app.task
    @with_lock(key=lambda report_id: f"report:{report_id}")
    def build_report(report_id): ...

The key callable receives the task's arguments by name (only those it names; positional or
keyword at call time does not matter); a string is a fixed key. A wrong ``limit``, ``key`` or
option raises :class:`~celery_redsem.ConfigurationError` here, at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from celery import Task
from celery._state import get_current_task
from celery.local import Proxy
from celery.signals import worker_init

from celery_redsem.core.errors import ConfigurationError
from celery_redsem.integration.guards.base import GUARD_ATTR, Guard
from celery_redsem.integration.guards.naming import KeyFunction, LimitFunction
from celery_redsem.integration.guards.rate_guard import RateGuard
from celery_redsem.integration.guards.reentry import current_permit, current_rate_limiter
from celery_redsem.integration.guards.semaphore_guard import GuardOptions, SemaphoreGuard

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = [
    "current_permit",
    "current_rate_limiter",
    "with_lock",
    "with_rate_limit",
    "with_semaphore",
]

P = ParamSpec("P")
R = TypeVar("R")


def with_semaphore(
    limit: int | LimitFunction,
    key: str | KeyFunction,
    *,
    lease: float | None = None,
    max_wait: float | None = None,
    lost_lease_policy: str | None = None,
    on_busy: str = "wait",
    dedupe: bool | str = False,
    debounce: float | None = None,
    debounce_max: float | None = None,
    fair_by: Callable[..., object] | None = None,
    weight: float | Callable[..., object] = 1,
    group_limit: int | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """At most ``limit`` runs of the task at once per key, across all workers.

    Args:
        limit: how many runs at once per key (an int >= 1), or a callable that gets the
            task's arguments by name, as ``key`` does, and returns it
            (``limit=lambda plan: 10 if plan == "pro" else 2``). A changed limit applies to
            new grants; runs holding a permit keep it.
        key: the semaphore name, or a callable that gets the task's arguments by name and
            returns it (a non-empty str of at most 512 characters without ``{`` or ``}``).
        lease: permit lease in seconds (default: ``redsem_lease``); the heartbeat refreshes it
            every lease/3 while the task runs.
        max_wait: seconds the task may wait for a permit over all its contention retries
            before it fails with :class:`~celery_redsem.AcquireTimeout` (default:
            ``redsem_max_wait``; ``math.inf``: no limit).
        lost_lease_policy: ``"log"`` or ``"raise"`` (default: ``redsem_lost_lease_policy``).
        on_busy: when no permit is free: ``"wait"`` its turn (the default), ``"skip"`` (end
            at once without running, state SUCCESS, result None, the
            :data:`~celery_redsem.signals.task_skipped` signal), or ``"fail"`` (fail at once
            with :class:`~celery_redsem.Busy`). Neither of the last two joins the line.
        dedupe: ``True``: while a run for the key is queued or running, sending the task
            again returns that run's ``AsyncResult`` and queues nothing; ``"raise"``: raises
            :class:`~celery_redsem.AlreadyQueued` instead (see :doc:`/coming-from-celery-once`);
            ``"coalesce"``: newest wins, at most one run running and one pending per key,
            the pending run taking the newest arguments of the sends it absorbs, whose
            results are its result (see :doc:`/choosing-dedupe`).
        debounce: with ``dedupe="coalesce"``: a run starts only once this many seconds
            passed (server clock) since the newest send for its key.
        debounce_max: bound on that wait, in seconds from the first send the run answers
            for (>= ``debounce``; default: none), for a stream that never goes quiet.
        fair_by: who shares the limit: a callable of the task's arguments by name returning
            the run's group (a str or int, ``fair_by=lambda account_id: account_id``). A free
            permit then goes to the group with the smallest share served, FIFO within a group
            (see :doc:`/fair-share`).
        weight: with ``fair_by``, the group's weight (a number > 0, default 1), or a callable
            of the task's arguments by name returning it: a group of weight 2 gets twice
            the share of one of weight 1 while both wait.
        group_limit: with ``fair_by``, at most this many runs of one group at once (an int
            >= 1; default: no cap besides ``limit``).
    """

    options = {
        "limit": limit,
        "key": key,
        "lease": lease,
        "max_wait": max_wait,
        "lost_lease_policy": lost_lease_policy,
        "on_busy": on_busy,
        "dedupe": dedupe,
        "debounce": debounce,
        "debounce_max": debounce_max,
        "fair_by": fair_by,
        "weight": weight,
        "group_limit": group_limit,
    }
    return _GuardDecorator(options)


_WRITTEN_BARE = (
    "@with_semaphore / @with_lock was written without its arguments, so the task is the bare "
    "decorator: write @with_lock(key=...) or @with_semaphore(limit=..., key=...)"
)


class _GuardDecorator:
    # What @with_semaphore(...) returns: applied to the task's function, it wraps it.
    # Written without its arguments (a bare @with_lock takes the function as its key),
    # this object itself would become the task. Celery reads a task function's __name__ or
    # __doc__ as it registers it (at import, or when the app is finalized), and here those
    # raise, so the mistake shows there and not only when the task first runs. (No
    # docstring: __doc__ is one of those properties.)

    def __init__(
        self, options: dict[str, Any], make_guard: Callable[..., Guard] = SemaphoreGuard
    ) -> None:
        self.options = options
        self.make_guard = make_guard  # SemaphoreGuard, or RateGuard for @with_rate_limit

    @property
    def __name__(self) -> str:
        raise ConfigurationError(_WRITTEN_BARE)

    @property
    def __doc__(self) -> str:  # type: ignore[override]
        raise ConfigurationError(_WRITTEN_BARE)

    def __call__(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        # Called with anything but one function, it is running as a task body: a task was
        # made of it where nothing read its name first.
        if kwargs or len(args) != 1 or not callable(args[0]) or args[0] is get_current_task():
            raise ConfigurationError(_WRITTEN_BARE)
        fn: Callable[..., Any] = args[0]
        _refuse_a_task(fn)
        guard = self.make_guard(fn, **self.options)
        _install_worker_hooks()  # a worker of this process then looks after guarded tasks

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return guard.run(args, kwargs)

        setattr(guarded, GUARD_ATTR, guard)
        # Celery checks a call's arguments against the task's signature when it is sent
        # (``Task.typing``), reading it with getfullargspec, which ignores ``__wrapped__``.
        guarded.__signature__ = guard.signature  # type: ignore[attr-defined]
        if guard.dedupe:
            from celery_redsem.integration.dedupe.sender import watch_sends

            watch_sends(guarded, guard)  # the sends of every task made of it take the mark
        return guarded


def _refuse_a_task(fn: object) -> None:
    """Raise if ``fn`` is already a Celery task: the guard must wrap the function under it.

    Above ``@app.task`` the guard would wrap only the module attribute, and the registered task
    (which beat, ``send_task`` and canvas call by name) would run with no limit at all.
    """
    # type(), not isinstance(): a Proxy's __class__ would evaluate (finalize) the task.
    if issubclass(type(fn), Task | Proxy):
        raise ConfigurationError(
            "@with_semaphore / @with_lock is above @app.task here: the registered task would "
            "run without it. Put it under @app.task, next to the "
            "function:\n    @app.task\n    @with_lock(...)\n    def my_task(...): ..."
        )


def with_lock(
    key: str | KeyFunction, **options: Unpack[GuardOptions]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """One run of the task at a time per key: :func:`with_semaphore` with ``limit=1`` (and its
    keyword options: ``lease``, ``max_wait``, ``lost_lease_policy``, ``on_busy``, ``dedupe``,
    ``debounce``, ``debounce_max``, ``fair_by``, ``weight``, ``group_limit``)."""
    return with_semaphore(1, key, **options)


def with_rate_limit(
    rate: str | float | Sequence[str | float],
    key: str | KeyFunction,
    *,
    burst: int | Sequence[int] | None = None,
    cost: int | LimitFunction = 1,
    max_wait: float | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """At most ``rate`` units per key, across all workers; each start of the task takes
    ``cost`` units (see :doc:`rate-limits`).

    Args:
        rate: ``"10/s"``, ``"100/m"``, ``"1000/h"``, ``"10000/d"`` (Celery's notation, and
            days) or units per second; or a list of them (``["10/s", "10000/d"]``): a start
            is admitted only when every window admits it, and takes its cost from all.
        key: the limiter's name, or a callable of the task's arguments by name returning it
            (the same rules as :func:`with_semaphore`'s ``key``).
        burst: units allowed at once after an idle spell: an int (the first window's) or one
            per window. Default: 1 for the first window (none beyond the rate's own spacing),
            each later window's own count (a budget spent at the pace of the first).
        cost: units a start takes (default 1): an int, or a callable of the task's arguments
            by name returning one (``cost=lambda prompt: estimate_tokens(prompt)``). At most
            the smallest burst: a larger fixed cost fails here, a larger computed one fails
            the run at once with :class:`~celery_redsem.KeyFunctionError`. Units known only
            after the body ran: ``current_rate_limiter().charge(units)``.
        max_wait: a run whose slot is further ahead fails with
            :class:`~celery_redsem.AcquireTimeout` (default: ``redsem_max_wait``).
    """
    options = {"rate": rate, "key": key, "burst": burst, "cost": cost, "max_wait": max_wait}
    return _GuardDecorator(options, RateGuard)


_hooked = False


def _install_worker_hooks() -> None:
    """Have every worker this process starts look after its guarded tasks (once per process).
    The worker side (:mod:`celery_redsem.integration.worker`) loads only then: a process that
    only sends tasks never loads it."""
    global _hooked  # noqa: PLW0603
    if not _hooked:
        worker_init.connect(_on_worker_init, weak=False, dispatch_uid=f"{__name__}.worker_init")
        _hooked = True


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    from celery_redsem.integration.worker.hooks import on_worker_init

    on_worker_init(sender)
