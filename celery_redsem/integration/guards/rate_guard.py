"""The guard of a ``@with_rate_limit`` task function: at most ``rate`` units per key, over one
window or several, each start taking ``cost`` units (an int, or a function of the task's
arguments by name; one above the smallest burst fails the run at once, visibly). The body
finds its key's limiter with :func:`~celery_redsem.current_rate_limiter`, to charge units known
only once it has run.

:class:`RateGuard` names the limiter of a call as a semaphore is named
(:class:`~celery_redsem.integration.guards.naming.KeyNaming`) and asks it once per run
(:class:`~celery_redsem.core.rate_limit.RateLimiter`, one round trip), under the run's permit id
(its task id), booking the next free slot when it is refused:

* **In a worker** a refused run is re-published (same task id) with a countdown of exactly the
  time until its booked slot, through the contention-retry path of
  :class:`~celery_redsem.integration.guards.contention.Contention`: it keeps ``request.retries`` and
  never
  touches ``max_retries``. Back at its slot it asks again and is admitted on its booking, so
  the runs of one key start in the order they first asked, and keys never wait for each other.
  A wait shorter than :data:`IN_SLOT` (and ``redsem_head_wait``) is slept in the worker slot
  instead: the broker trip would take about as long. A slot further than ``max_wait`` ahead is
  not booked: the task fails with :class:`~celery_redsem.AcquireTimeout`. Redis errors retry as
  for a semaphore.
* **Eager and direct calls** sleep until their slot, for at most ``redsem_eager_timeout``.

In a prefork worker, admission (:mod:`~celery_redsem.integration.admission.dispatcher`) asks first,
at
dispatch, for a task whose only guard is a rate guard: it *reserves* the run's slot (the next
free one, kept for its task id) and parks the task in the main process until :data:`LEAD`
before that slot, holding no pool slot and making no broker trip; then the task goes to its
child, which takes the slot (sleeping the last moment in its slot). The admission that the rate
spaces is the child's, just before the body starts: the time a task spends between dispatch and
its child (more under load, and for a child's first task) never lets two starts come closer
than the rate allows. A run admitted at dispatch, by contrast, could start late and bunch up
with the next one.
Stacked with ``@with_semaphore`` the outer decorator asks first; under it (the
semaphore outermost) a run counts toward the rate only once it holds its permit. A permit the
main process granted for an inner semaphore is given back when the rate guard retries the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NoReturn, cast

from celery import Celery, Task
from celery._state import get_current_app, get_current_task
from celery.app.task import Context

from celery_redsem.core.errors import AcquireTimeout, BackendError, ConfigurationError
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.rate_limit import RateLimiter, RateResult, pause_rate_limiter
from celery_redsem.core.rate_spec import make_windows
from celery_redsem.core.validation import count_rule
from celery_redsem.integration.guards.base import Guard, guards_of
from celery_redsem.integration.guards.contention import Contention, paused_recheck
from celery_redsem.integration.guards.naming import (
    KeyFunction,
    LimitFunction,
    LimitRule,
    call_arguments,
)
from celery_redsem.integration.guards.reentry import current_rate_limiter, enter_rate, leave_rate
from celery_redsem.integration.settings import RedsemConfig, get_client, get_config
from celery_redsem.integration.wire import read_wait

__all__ = ["IN_SLOT", "LEAD", "RateGuard", "pause_and_retry", "paused_recheck"]

#: Seconds a refused run waits for its slot in the worker slot rather than through the broker.
IN_SLOT = 0.05
#: Seconds before its reserved slot a run parked by admission goes to its child (at most half
#: of :data:`IN_SLOT` and of ``redsem_head_wait``): time for the hand-over to the child, so the
#: child is there to take the slot on time, sleeping the rest in its slot. A child later than
#: this delays the key's later slots by its lateness (the rate is never exceeded to catch up).
LEAD = 0.02


class RateGuard(Guard, kind="rate"):
    """The rate, burst and key of one ``@with_rate_limit`` task function: :meth:`run` calls it
    once its limiter admits the run, and :meth:`wait_at_dispatch` books the start of a run that
    admission parks in a worker's main process."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        key: str | KeyFunction,
        rate: str | float | Sequence[str | float],
        burst: int | Sequence[int] | None = None,
        cost: int | LimitFunction = 1,
        max_wait: float | None = None,
    ) -> None:
        where = getattr(fn, "__qualname__", repr(fn))
        self.windows = make_windows(rate, burst, where=f"rate of {where}")
        self._rate, self._burst = rate, burst
        self.rate = self.windows[0].rate
        self.burst = self.windows[0].burst
        self.rate_text = " + ".join(w.text for w in self.windows)
        largest = min(w.burst for w in self.windows)
        self.cost = LimitRule(fn, cost, where, what="cost", rule=count_rule(maximum=largest))
        super().__init__(fn, key, max_wait)

    def __repr__(self) -> str:
        return f"<RateGuard {self.where} rate={self.rate_text!r} key={self.key!r}>"

    def limiter(self, app: Celery, name: str, config: RedsemConfig | None = None) -> RateLimiter:
        """The rate limiter ``name`` with this guard's windows and the app's settings."""
        config = config or get_config(app)
        return RateLimiter(
            get_client(app), name, self._rate, burst=self._burst, prefix=config.key_prefix
        )

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the function once the limiter admits this run (see the module docstring)."""
        task = cast("Task[Any, Any] | None", get_current_task())
        ours = task is not None and self in guards_of(task, RateGuard)
        app = task.app if task is not None else get_current_app()
        task_name = task.name if task is not None and ours else self.fn.__qualname__
        config = get_config(app)
        limiter = self.limiter(app, self.naming.name_for(task_name, args, kwargs), config)
        cost = self.cost.limit_for(task_name, args, kwargs)
        request = task.request if task is not None and ours else None
        if request is None or request.called_directly or request.is_eager:
            permit_id = permit_id_of(request) if request is not None and request.id else None
            if not limiter.wait(config.eager_timeout, permit_id=permit_id, cost=cost):
                raise AcquireTimeout(
                    f"task {task_name} (eager or direct call) got no slot of rate limiter "
                    f"{limiter.name!r} ({self.rate_text}) within "
                    f"redsem_eager_timeout={config.eager_timeout}s",
                    name=limiter.name,
                    permit_id=permit_id,
                )
        else:
            assert task is not None
            self._admit_in_worker(task, request, limiter, config, (args, kwargs), cost=cost)
        entered = enter_rate(limiter)
        try:
            return self.fn(*args, **kwargs)
        finally:
            leave_rate(entered)

    def wait_at_dispatch(
        self, app: Celery, task: Task[Any, Any], request: Any, horizon: float
    ) -> float | None:
        """For admission in a worker's main process: reserve the run ``request``'s slot and
        tell how long to park it: 0.0 to hand it to its child now (its slot is due within
        :data:`LEAD`, or it was admitted before), the seconds until :data:`LEAD` before its slot,
        or None if its child should decide (no slot within ``horizon`` or ``max_wait``). The
        child then takes the slot under the same task id."""
        config = get_config(app)
        args, kwargs = call_arguments(task, request.args), request.kwargs or {}
        name = self.naming.name_for(task.name, args, kwargs)
        try:
            cost = self.cost.limit_for(task.name, args, kwargs)
        except ConfigurationError:
            return None  # its child fails it, visibly
        max_wait = self.max_wait_for(config.max_wait)
        ahead = horizon if max_wait is None else min(horizon, max_wait)
        if ahead <= 0:
            return None
        result = self.limiter(app, name, config).attempt(
            permit_id_of(request), cost=cost, reserve=True, max_wait=ahead
        )
        if result.paused:  # parked to the pause's end, asking again at least this often
            return min(result.retry_after, ahead, paused_recheck(config))
        if result.admitted:
            return 0.0
        if not result.booked:
            return None
        lead = min(LEAD, IN_SLOT / 2, config.head_wait / 2)
        return max(0.0, result.retry_after - lead)

    def _admit_in_worker(
        self,
        task: Task[Any, Any],
        request: Context,
        limiter: RateLimiter,
        config: RedsemConfig,
        call: tuple[tuple[Any, ...], dict[str, Any]],
        *,
        cost: int,
    ) -> None:
        """Return once admitted; else re-publish the run for its slot (raises ``Retry``)."""
        max_wait = self.max_wait_for(config.max_wait)
        what = f"a start of rate limiter {limiter.name!r} ({self.rate_text})"
        ask = Contention(task, request, limiter.name, what, max_wait, config)
        permit_id = permit_id_of(request)
        in_slot = min(IN_SLOT, config.head_wait)
        started = time.monotonic()
        try:
            result = limiter.attempt(permit_id, cost=cost, book=True, max_wait=max_wait)
            while not result.admitted and result.booked and result.retry_after <= in_slot:
                time.sleep(result.retry_after)
                result = limiter.attempt(permit_id, cost=cost, book=True, max_wait=max_wait)
        except BackendError as exc:
            ask.retry_after_error(exc, started=started)
        if result.admitted:
            return
        if result.paused:
            # To the pause's end (asking again at least this often: a resume takes effect),
            # whatever max_wait says: a paused key holds its runs, it fails none.
            result = replace(result, retry_after=min(result.retry_after, paused_recheck(config)))
        elif not result.booked:
            raise AcquireTimeout(
                f"task {task.name}[{request.id}] would wait {result.retry_after:.1f}s for a slot "
                f"of rate limiter {limiter.name!r} ({self.rate_text}), more than "
                f"max_wait={max_wait}s",
                name=limiter.name,
                permit_id=permit_id,
            )
        # A permit the main process granted for a semaphore under this guard goes back: the
        # run leaves now, and the grant must not wait for its lease to end or travel on.
        for guard in guards_of(task):
            if guard.give_back_grant(task, request, call):
                break
        # A contention retry like a semaphore's: counted in the header (not back from a line).
        earlier = read_wait(request)
        wait = earlier._replace(attempts=earlier.attempts + 1, due_ms=0, offline_ms=0)
        raise ask.publish_retry(
            result.retry_after, wait, release=None, reason=_booked(limiter, self, result)
        )


def _booked(limiter: RateLimiter, guard: RateGuard, result: RateResult) -> str:
    if result.paused:
        return f"rate limiter {limiter.name!r} ({guard.rate_text}) is paused"
    return (
        f"rate limiter {limiter.name!r} ({guard.rate_text}) booked a slot "
        f"{result.retry_after:.3f}s ahead"
    )


def pause_and_retry(seconds: float) -> NoReturn:
    """From the body of a ``@with_rate_limit`` or ``@with_semaphore`` task in a worker whose
    call was refused for a while (HTTP 429 with ``Retry-After: 30``): pause the run's key (its
    rate limiter's and its semaphore's name) for ``seconds`` on every worker (a longer pause
    already set stays), and queue this run again for the pause's end, as a contention retry
    (``max_retries`` untouched); its permit goes back as the run ends. Its next start takes a
    new unit. Raises Celery's ``Retry``; a ConfigurationError outside such a body, or in an
    eager or direct call (the key is paused all the same when there is one)."""
    task = cast("Task[Any, Any] | None", get_current_task())
    limiter = current_rate_limiter()
    held = getattr(task.request, "redsem_permit", None) if task is not None else None
    if task is None or (limiter is None and held is None):
        raise ConfigurationError(
            "pause_and_retry() runs in the body of a @with_rate_limit or @with_semaphore task"
        )
    request = task.request
    permit_id = permit_id_of(request)
    paused: list[tuple[str, str, float]] = []  # (name, what, seconds left)
    if limiter is not None:
        left = limiter.pause(seconds, forget=permit_id)
        paused.append((limiter.name, f"rate limiter {limiter.name!r}", left))
    if held is not None:
        permit = held.permit
        left = pause_rate_limiter(held.client, permit.name, seconds, prefix=permit.prefix)
        paused.append((permit.name, f"semaphore {permit.name!r}", left))
    name, what = paused[0][0], " and ".join(p[1] for p in paused)
    left = max(p[2] for p in paused)
    if request.called_directly or request.is_eager:
        raise ConfigurationError(
            f"pause_and_retry(): {what} is paused for {left:.3f}s, but "
            "an eager or direct call cannot be queued again",
            name=name,
        )
    config = get_config(task.app)
    ask = Contention(task, request, name, "a paused key", None, config)
    reason = f"the body paused {what} for {left:.3f}s"
    raise ask.retry_paused(left, reason)
