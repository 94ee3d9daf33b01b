"""Admission at dispatch: a prefork worker gives a pool slot only to a task that has its permit.

The prefork pool's main process hands a task to a child only when one of its slots is free
(Celery's slot semaphore). Just then, for a task with one guard, :class:`Admission` asks for
the permit (one round trip, joining the FIFO line under the task run's permit id: its task
id, marked for a run its own retry queued; see
:func:`~celery_redsem.core.permit_ids.run_permit_id`):

* **Granted**: the task goes to the child with the permit
  (:mod:`~celery_redsem.integration.handoff`), so the child does not ask again.
* **Not granted**: the task is *parked* in the main process and its slot goes to the next task,
  so a contended task costs no slot time and no trip through the broker. Its place in line does
  not hold a free permit while it is parked (``back_in``), so nobody waits for it. It asks again
  when its turn is expected (:mod:`~celery_redsem.integration.parking`: its position times the
  hold time learnt from tasks that finished on this worker, over the limit), or at once when a
  task of the same semaphore finishes here (a release-driven wake-up of the first one parked),
  and then goes to the front of the slot queue.

A deep line costs a task O(1) round trips: one when it reaches the worker (which also tells
Redis when the task will be back, guessed from the tasks parked here ahead of it), then one
when it is woken or its turn is expected. A parked task widens the prefetch window by one, as
an ETA task does, so the worker keeps fetching: a burst on one hot key is reserved by the
worker, unacknowledged, instead of cycling through the broker, and tasks for other keys queued
behind it reach a free slot at once. At most
:data:`~celery_redsem.integration.parking.MAX_PARKED_TASKS` are parked per worker; past that a
task goes to its child, which decides as without admission (most often: a retry through the
broker with a countdown). If the worker stops or loses its broker connection, the broker
delivers the parked messages again (a parked task from a lost connection is dropped, never run
twice). One delivery is parked only until
:data:`~celery_redsem.integration.parking.MAX_PARKED` seconds, and at most half the broker's
``visibility_timeout``, have passed since it reached the worker (time spent waiting for a slot
counts: the broker's clock runs from delivery): then it goes to a child, which retries it
through the broker (acknowledging this message) before the broker would deliver it a second
time. Its total wait counts toward ``redsem_max_wait``; once that is spent it goes to a child,
which fails it with :class:`~celery_redsem.AcquireTimeout`.

The key function runs here, in the event loop, before every dispatch of a guarded task: a
task whose key function once takes longer than :data:`SLOW_KEY_FUNCTION` is left to the pool
children from then on, with a warning.

Anything unusual hands the task to the child unchanged, which then waits or retries as
:mod:`celery_redsem.integration.retrying` describes: pools without a slot semaphore (solo,
threads, gevent, eventlet), tasks with several guards, a key function that fails (the child
reports it), ``min_replicas`` (its ``WAIT`` would stall the event loop), a worker that is
shutting down (its parked tasks are left to be delivered again), and Redis errors (admission
pauses for :data:`PAUSE_AFTER_ERROR` seconds, longer after each error in a row).
``redsem_worker_admission = False`` turns it off.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import suppress
from typing import Any

from celery import Celery, bootsteps
from celery.app.task import Context
from celery.worker import state as worker_state

from celery_redsem.core.errors import BackendError
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit
from celery_redsem.integration.backoff import hold_times
from celery_redsem.integration.config import RedsemConfig, get_config
from celery_redsem.integration.handoff import clear_grant, hand_over
from celery_redsem.integration.metrics import record_admission_grant, record_park, record_unpark
from celery_redsem.integration.naming import call_arguments
from celery_redsem.integration.parking import (
    MAX_PARK,
    MAX_PARKED,
    MAX_PARKED_TASKS,
    MIN_PARK,
    Parked,
    ParkedTasks,
    park_time,
)
from celery_redsem.integration.rate_guard import RateGuard, rate_guards_of
from celery_redsem.integration.task_guard import TaskGuard, guards_of
from celery_redsem.integration.waiting import (
    WaitState,
    attempt,
    present_waiter_lease,
    read_wait,
    server_ms,
    stamp_wait,
)

__all__ = [
    "MAX_PAUSE_AFTER_ERROR",
    "PAUSE_AFTER_ERROR",
    "SLOW_KEY_FUNCTION",
    "Admission",
    "install_admission",
]

logger = logging.getLogger(__name__)

_BLUEPRINT_RUNNING: int = bootsteps.RUN  # type: ignore[attr-defined]  # (not in the stubs)

#: Seconds admission hands every task straight to the pool after a Redis error, doubling
#: with each error in a row up to :data:`MAX_PAUSE_AFTER_ERROR`: a Redis that hangs (rather
#: than refuses) blocks the event loop for a socket timeout at each try.
PAUSE_AFTER_ERROR = 5.0
MAX_PAUSE_AFTER_ERROR = 60.0
#: A key function that takes longer than this (seconds) in the worker's main process, where
#: it holds up every other task's dispatch, is left to the pool children from then on.
SLOW_KEY_FUNCTION = 0.05


class Admission:
    """Asks for the permit of a guarded task when a pool slot is free; parks it if none is."""

    def __init__(self, controller: Any, app: Celery) -> None:
        self.controller = controller
        self.app = app
        #: Parked requests, by request and by semaphore name.
        self.parked = ParkedTasks()
        self._dispatch = controller._process_task  # the worker's own: hands to the pool
        #: Requests handed to the pool with a grant, by permit id, until each run ends.
        self._handed: dict[str, list[Any]] = {}
        self._usable: bool | None = None
        self._paused_until = 0.0
        self._errors_in_row = 0  # Redis errors since admission last got an answer
        #: Tasks whose key function was too slow to run here (:data:`SLOW_KEY_FUNCTION`).
        self._slow_keys: set[str] = set()

    # -- the hook -------------------------------------------------------------------------

    def process_task(self, req: Any) -> Any:
        """Stands in for the worker's ``_process_task``: called with a slot taken for ``req``."""
        earlier = self.parked.remove(req)
        record_unpark(earlier)
        clear_grant(req.request_dict)
        if self._stopping():  # a grant now might never run here: the child asks, if it runs
            return self._dispatch(req)
        guard = self._guard_to_admit(req)
        if guard is None:
            return self._dispatch(req)
        try:
            granted = None
            if isinstance(guard, RateGuard):
                self._ask_rate(req, guard, earlier)
            else:
                granted = self._ask(req, guard, earlier)
        except BackendError as exc:
            pause = min(MAX_PAUSE_AFTER_ERROR, PAUSE_AFTER_ERROR * 2.0**self._errors_in_row)
            self._errors_in_row += 1
            self._paused_until = time.monotonic() + pause
            logger.warning(
                "celery_redsem: admission paused for %.0fs after a Redis error: %s", pause, exc
            )
            granted = None
        except Exception:  # never lose a task to a bug here: the child decides
            logger.exception("celery_redsem: admission failed for %s[%s]", req.name, req.id)
            granted = None
        if req in self.parked:
            return None
        if granted is not None:
            permit, granted_at = granted
            record_admission_grant(req, permit, earlier.first_ms if earlier else -1)
            hand_over(req.request_dict, permit, granted_at)
            self._handed.setdefault(permit_id_of(req), []).append(req)
            self._watch(req, permit.name)
        return self._dispatch(req)

    def _stopping(self) -> bool:
        """Whether the worker is shutting down (its pool may run nothing more)."""
        for flag in (worker_state.should_stop, worker_state.should_terminate):
            if flag is not None and flag is not False:  # an exit code, 0 included
                return True
        blueprint = getattr(self.controller, "blueprint", None)
        state: object = getattr(blueprint, "state", _BLUEPRINT_RUNNING)
        return state != _BLUEPRINT_RUNNING

    def _guard_to_admit(self, req: Any) -> TaskGuard | RateGuard | None:
        """The one guard of ``req``'s task if admission decides for it, else None."""
        if self._usable is None:
            self._usable = _slot_semaphore(self.controller) is not None
            if not self._usable:
                logger.debug("celery_redsem: this pool has no slot semaphore: no admission")
        if not self._usable or time.monotonic() < self._paused_until:
            return None
        task = getattr(req, "task", None)
        if task is None or task.name in self._slow_keys:
            return None
        guards: list[TaskGuard | RateGuard] = [*guards_of(task), *rate_guards_of(task)]
        if len(guards) != 1 or req.revoked():
            return None
        if getattr(guards[0], "on_busy", "wait") != "wait":
            return None  # one try, never parked: its child asks, then runs, skips or fails
        return guards[0]

    # -- asking ---------------------------------------------------------------------------

    def _ask(
        self, req: Any, guard: TaskGuard, earlier: Parked | None
    ) -> tuple[Permit, float] | None:
        """Ask for ``req``'s permit: the permit and the monotonic time it was asked for if
        granted; None if not (then ``req`` is parked, its slot given back) or if the child
        should decide."""
        task = req.task
        config = get_config(self.app)
        started = time.monotonic()
        try:
            name, limit = guard.name_and_limit(
                task.name, call_arguments(task, req.args), req.kwargs or {}
            )
        except Exception:  # the child reports a bad key (or limit) function, visibly
            return None
        finally:
            self._time_key_function(task.name, time.monotonic() - started)
        sem = guard.semaphore(self.app, name, config, limit)
        if sem.min_replicas:
            return None
        run = permit_id_of(req)
        if self._runs_here(req, run):
            self._park_copy(req, name, earlier)
            return None
        hold = hold_times.estimate(task.name)
        tries = earlier.tries + 1 if earlier is not None else 0
        longest = self._longest_park()
        behind = None if earlier is not None else self.parked.deepest_position(name)
        lease, back_in = self._first_lease(config, sem.limit, behind, hold, longest)
        asked = time.monotonic()
        result = attempt(sem, run, waiter_lease=lease, back_in=back_in)
        self._errors_in_row = 0
        if isinstance(result, Permit):
            return result, asked
        now_ms = server_ms(result, lease)
        if earlier is not None and earlier.first_ms >= 0:
            first_ms = earlier.first_ms
        else:
            first_ms = min(_read_wait(req).first_ms or now_ms, now_ms)  # never in the future
        park = park_time(
            position=result.position, limit=sem.limit, hold=hold, tries=tries, longest=longest
        )
        waited = (now_ms - first_ms) / 1000
        max_wait = guard.max_wait_for(config)
        if max_wait is not None:
            if waited >= max_wait:  # the child fails it with AcquireTimeout
                _stamp_wait(req, first_ms)
                return None
            park = min(park, max(MIN_PARK, max_wait - waited))
        received_at = _received_at(req, earlier, asked)
        held_for = asked - received_at  # the broker's visibility clock runs from delivery
        if held_for >= longest or len(self.parked) >= MAX_PARKED_TASKS:
            # The child decides, most often a retry: a new message (with a countdown, held as
            # an ETA task is), this one acknowledged.
            _stamp_wait(req, first_ms)
            return None
        park = min(park, max(MIN_PARK, longest - held_for))
        if back_in and park <= back_in:
            # Back before its place expects it: its place is kept (it ends a margin after
            # back_in), and asking early only competes for a free permit.
            position = result.position
        else:
            asked = time.monotonic()
            again = attempt(sem, run, waiter_lease=park + config.waiter_margin, back_in=park)
            if isinstance(again, Permit):
                return again, asked
            position = again.position
        self._park(Parked(req, name, position, first_ms, tries, None, received_at), park)
        return None

    def _ask_rate(self, req: Any, guard: RateGuard, earlier: Parked | None) -> None:
        """A task whose only guard is a rate limit: dispatched once its limiter admits it,
        else parked until exactly the slot booked for it (no pool slot, no broker trip)."""
        received_at = _received_at(req, earlier, time.monotonic())
        horizon = self._longest_park() - (time.monotonic() - received_at)
        wait = guard.wait_at_dispatch(self.app, req.task, req, horizon)
        self._errors_in_row = 0
        if wait:  # 0.0: admitted; None: its child decides
            tries = earlier.tries + 1 if earlier is not None else 0
            # Under a name no semaphore can have (names have no braces): no release wakes it.
            self._park(Parked(req, "{rate}", 0, 0, tries, None, received_at), wait)

    @staticmethod
    def _first_lease(
        config: RedsemConfig, limit: int, behind: int | None, hold: float | None, longest: float
    ) -> tuple[float, float]:
        """The waiter lease and ``back_in`` of a task's first try: present, or, arriving behind
        tasks parked here on its semaphore (the last at place ``behind``), away for about as
        long as the one place after theirs waits: one call both asks and tells Redis when it
        will be back (until then its place holds no free permit for it)."""
        if behind is None:
            return present_waiter_lease(config), 0.0
        back_in = park_time(position=behind + 1, limit=limit, hold=hold, tries=0, longest=longest)
        return back_in + config.waiter_margin, back_in

    def _time_key_function(self, task_name: str, took: float) -> None:
        """Leave ``task_name`` to the pool children if its key function took ``took`` seconds
        (over :data:`SLOW_KEY_FUNCTION`): here it holds up every other task's dispatch."""
        if took > SLOW_KEY_FUNCTION and task_name not in self._slow_keys:
            self._slow_keys.add(task_name)
            logger.warning(
                "celery_redsem: the key function of %s took %.3fs in the worker's main process, "
                "where it holds up the dispatch of every task; from now on %s asks for its "
                "permit in its pool child. Make the key a quick function of the arguments "
                "(no database or network calls) to keep admission at dispatch.",
                task_name,
                took,
                task_name,
            )

    def _runs_here(self, req: Any, run: str) -> bool:
        """Whether another delivery of ``req``'s run (same task id and permit id) runs on this
        worker now (the broker delivered it again, say after a lost connection, while the
        first delivery goes on). ``run``: its permit id."""
        live = worker_state.reserved_requests | worker_state.active_requests  # not ended yet
        handed = [r for r in self._handed.get(run, ()) if r is not req and r in live]
        if handed:
            return True
        self._handed.pop(run, None)  # ended without telling us (never ran), if any are left
        return any(
            r.id == req.id and r is not req and permit_id_of(r) == run
            for r in list(worker_state.active_requests)
        )

    def _park_copy(self, req: Any, name: str, earlier: Parked | None) -> None:
        """Park a second delivery of a running task run until that run ends.

        The permit is the run's, so this copy would get it too, and the first run's end
        would release it under the second: the two would run at once, and a third task could
        join them. Parked, it asks again when that run ends, so the copies run one after the
        other, as at-least-once delivery does. (Parked past half the broker's visibility
        timeout, it may be delivered once more: that copy waits its turn too.)
        """
        tries = earlier.tries if earlier is not None else 0  # not a try for a permit
        first_ms = earlier.first_ms if earlier is not None else -1  # not waiting for a permit
        received_at = _received_at(req, earlier, time.monotonic())
        self._park(Parked(req, name, 0, first_ms, tries, None, received_at), MAX_PARK)

    def _longest_park(self) -> float:
        """How long one delivery may stay parked (unacknowledged): :data:`MAX_PARKED`, and at
        most half the broker's ``visibility_timeout`` (Redis, SQS), after which the broker
        would deliver the message again and a second copy of the task would run."""
        options = self.app.conf.broker_transport_options or {}
        visibility = options.get("visibility_timeout")
        if isinstance(visibility, bool) or not isinstance(visibility, int | float):
            return MAX_PARKED
        return min(MAX_PARKED, visibility / 2) if visibility > 0 else MAX_PARKED

    # -- finished tasks wake parked ones -------------------------------------------------

    def _watch(self, req: Any, name: str) -> None:
        """When ``req`` (granted here) ends, learn its hold and wake a task parked on ``name``.

        The pool calls the request's ``on_success`` or ``on_failure`` bound when it is handed
        over, so wrapping them on the instance sees every end.
        """
        started = time.monotonic()
        task_name = req.task.name
        run = permit_id_of(req)
        done = False

        def finished() -> None:
            nonlocal done
            if not done:
                done = True
                handed = self._handed.get(run, [])
                if req in handed:
                    handed.remove(req)
                if not handed:
                    self._handed.pop(run, None)
                hold_times.observe(task_name, time.monotonic() - started)
                self._wake_one(name, run)

        def wrap(callback: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                try:
                    return callback(*args, **kwargs)
                finally:
                    finished()

            return wrapped

        req.on_success = wrap(req.on_success)
        req.on_failure = wrap(req.on_failure)

    def _wake_one(self, name: str, ended_id: str) -> None:
        """A run of task ``ended_id`` gave back a permit of ``name`` here: the first task
        parked on it asks again, and so do copies of ``ended_id`` that waited for that run."""
        # Not one already resumed (waiting for a slot): it asks again anyway.
        waiting = [p for p in self.parked.on(name) if p.timer is not None]
        in_line = [p for p in waiting if p.first_ms >= 0]  # (copies of a running id are not)
        woken = [p for p in waiting if p.first_ms < 0 and permit_id_of(p.req) == ended_id]
        if in_line:
            woken.append(min(in_line, key=lambda p: p.position))
        for parked in woken:
            with suppress(Exception):
                self.controller.timer.cancel(parked.timer)
            self._resume(parked.req)

    # -- parking --------------------------------------------------------------------------

    def _park(self, parked: Parked, seconds: float) -> None:
        controller = self.controller
        consumer = controller.consumer
        parked.connection = getattr(consumer, "connection", None)
        parked.qos = consumer.qos
        parked.qos.increment_eventually()  # as for an ETA task: keep fetching others
        self.parked.add(parked)
        record_park(parked.req)
        parked.timer = controller.timer.call_after(seconds, self._resume, (parked.req,), priority=6)
        semaphore = _slot_semaphore(controller)
        assert semaphore is not None
        hub = getattr(controller, "hub", None)
        if hub is not None:  # not now: release() may hand the slot to the next task at once
            hub.call_soon(semaphore.release)
        else:
            semaphore.release()

    def _resume(self, req: Any) -> None:
        """``req`` asks again, first in the slot queue."""
        parked = self.parked.get(req)
        if parked is None or parked.timer is None:
            return
        parked.timer = None  # resumed once: a later timer or wake-up does nothing
        consumer = self.controller.consumer
        # Give back the prefetch it took from the window it was counted in, if it took one
        # (after a reconnection the consumer has a new window, which never counted it).
        if parked.qos is not None:
            parked.qos.decrement_eventually()
        if self._stopping() or getattr(consumer, "connection", None) is not parked.connection:
            record_unpark(parked)
            self.parked.remove(req)  # its message will be delivered again
            return
        semaphore = _slot_semaphore(self.controller)
        assert semaphore is not None
        if semaphore.value > 0:
            semaphore.acquire(self.controller._process_task, req)
        else:
            semaphore._waiting.appendleft((self.controller._process_task, (req,), {}))


def _slot_semaphore(controller: Any) -> Any:
    """The worker's slot semaphore (a kombu ``LaxBoundedSemaphore``) if its pool uses one."""
    semaphore = getattr(controller, "semaphore", None)
    uses_it = getattr(controller, "process_task", None) == getattr(
        controller, "_process_task_sem", object()
    )
    if (
        semaphore is None
        or not uses_it
        or not isinstance(getattr(semaphore, "_waiting", None), deque)
        or getattr(controller, "timer", None) is None
        or getattr(controller, "consumer", None) is None
    ):
        return None
    return semaphore


def _received_at(req: Any, earlier: Parked | None, now: float) -> float:
    """When ``req``'s delivery reached the worker (monotonic): as parked before, else as its
    :class:`~celery_redsem.integration.worker.ReleasingRequest` noted, else ``now``."""
    if earlier is not None:
        return earlier.received_at
    received = getattr(req, "redsem_received_at", None)
    return received if isinstance(received, float) else now


def _read_wait(req: Any) -> WaitState:
    return read_wait(Context(req.request_dict))


def _stamp_wait(req: Any, first_ms: int) -> None:
    """Tell the child when the wait began (it fails the task once ``max_wait`` is spent)."""
    wait = _read_wait(req)
    stamp_wait(req.request_dict, WaitState(wait.attempts, first_ms, wait.errors, 0, 0))


def install_admission(controller: Any, app: Celery) -> Admission | None:
    """Install :class:`Admission` on a worker (at ``worker_init``); None if already there."""
    if isinstance(getattr(controller, "_redsem_admission", None), Admission):
        return None
    admission = Admission(controller, app)
    controller._redsem_admission = admission
    controller._process_task = admission.process_task
    return admission
