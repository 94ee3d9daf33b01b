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
  when its turn is expected (:func:`park_time`: its position times the hold time learnt from
  tasks that finished on this worker, over the limit), or at once when a task of the same
  semaphore finishes here, and then goes to the front of the slot queue.

A parked task widens the prefetch window by one, as an ETA task does, so the worker keeps
fetching tasks it can run. At most a window's worth (concurrency x prefetch multiplier) are
parked so; a task that finds the window widened that far goes to its child instead, which
decides as without admission (most often: a retry through the broker with a countdown). Parked
without widening, it would take a place of the window, and a window full of tasks for one busy
key would stop the worker fetching the tasks behind them while its slots sat idle. A parked
task stays reserved by the worker, unacknowledged: if the worker stops or loses its broker
connection, the broker delivers the message again (a parked task from a lost connection is
dropped, never run twice). One delivery is parked only until :data:`MAX_PARKED` seconds, and
at most half the broker's ``visibility_timeout``, have passed since it reached the worker
(time spent waiting for a slot counts: the broker's clock runs from delivery): then it goes to
a child, which retries it through the broker (acknowledging this message) before the broker
would deliver it a second time. Its total wait counts toward ``redsem_max_wait``; once that is
spent it goes to a child, which fails it with :class:`~celery_redsem.AcquireTimeout`.

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
from dataclasses import dataclass
from typing import Any

from celery import Celery, bootsteps
from celery.app.task import Context
from celery.worker import state as worker_state

from celery_redsem.core.errors import BackendError
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit
from celery_redsem.integration.backoff import hold_times
from celery_redsem.integration.config import get_config
from celery_redsem.integration.handoff import clear_grant, hand_over
from celery_redsem.integration.naming import call_arguments
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
    "park_time",
]

logger = logging.getLogger(__name__)

_BLUEPRINT_RUNNING: int = bootsteps.RUN  # type: ignore[attr-defined]  # (not in the stubs)

#: Seconds admission hands every task straight to the pool after a Redis error, doubling
#: with each error in a row up to :data:`MAX_PAUSE_AFTER_ERROR`: a Redis that hangs (rather
#: than refuses) blocks the event loop for a socket timeout at each try.
PAUSE_AFTER_ERROR = 5.0
MAX_PAUSE_AFTER_ERROR = 60.0
#: Bounds on how long a parked task waits before it asks again.
MIN_PARK = 0.002
MAX_PARK = 1.0
#: Until a hold time of its task is known, a parked task asks again after this, doubling.
FIRST_PARK = 0.01
#: A parked task asks again a little before its turn is expected.
EARLY = 0.8
#: Seconds after its delivery a task may still be parked; then its child retries it through
#: the broker.
MAX_PARKED = 60.0
#: A key function that takes longer than this (seconds) in the worker's main process, where
#: it holds up every other task's dispatch, is left to the pool children from then on.
SLOW_KEY_FUNCTION = 0.05


def park_time(*, position: int, limit: int, hold: float | None, tries: int) -> float:
    """Seconds a parked task at ``position`` waits before asking again.

    About when ``position`` holders of ``hold`` seconds have left a ``limit`` semaphore, a
    little early; until a hold time is known, :data:`FIRST_PARK` doubling with each try.
    """
    if hold is None:
        return min(MAX_PARK, FIRST_PARK * 2.0 ** min(tries, 32))
    return min(MAX_PARK, max(MIN_PARK, EARLY * position * hold / limit))


@dataclass
class _Parked:
    """A request parked for its permit."""

    req: Any
    name: str
    position: int
    first_ms: int  # server ms when its wait began (-1: not waiting for a permit yet)
    tries: int
    connection: Any  # the consumer's broker connection when it was parked
    received_at: float  # monotonic time this delivery reached the worker
    timer: Any = None
    qos: Any = None  # the consumer's prefetch window it widened, if it did


class Admission:
    """Asks for the permit of a guarded task when a pool slot is free; parks it if none is."""

    def __init__(self, controller: Any, app: Celery) -> None:
        self.controller = controller
        self.app = app
        #: Parked requests, by request: two deliveries of one task id are parked apart.
        self.parked: dict[Any, _Parked] = {}
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
        earlier = self.parked.pop(req, None)
        clear_grant(req.request_dict)
        if self._stopping():  # a grant now might never run here: the child asks, if it runs
            return self._dispatch(req)
        guard = self._guard_to_admit(req)
        if guard is None:
            return self._dispatch(req)
        try:
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

    def _guard_to_admit(self, req: Any) -> TaskGuard | None:
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
        guards = guards_of(task)
        if len(guards) != 1 or req.revoked():
            return None
        return guards[0]

    # -- asking ---------------------------------------------------------------------------

    def _ask(
        self, req: Any, guard: TaskGuard, earlier: _Parked | None
    ) -> tuple[Permit, float] | None:
        """Ask for ``req``'s permit: the permit and the monotonic time it was asked for if
        granted; None if not (then ``req`` is parked, its slot given back) or if the child
        should decide."""
        task = req.task
        config = get_config(self.app)
        started = time.monotonic()
        try:
            name = guard.name_for(task.name, call_arguments(task, req.args), req.kwargs or {})
        except Exception:  # the child reports a bad key function, visibly
            return None
        finally:
            self._time_key_function(task.name, time.monotonic() - started)
        sem = guard.semaphore(self.app, name, config)
        if sem.min_replicas:
            return None
        run = permit_id_of(req)
        if self._runs_here(req, run):
            self._park_copy(req, name, earlier)
            return None
        present = present_waiter_lease(config)
        asked = time.monotonic()
        result = attempt(sem, run, waiter_lease=present)
        self._errors_in_row = 0
        if isinstance(result, Permit):
            return result, asked
        now_ms = server_ms(result, present)
        if earlier is not None and earlier.first_ms >= 0:
            first_ms = earlier.first_ms
        else:
            first_ms = min(_read_wait(req).first_ms or now_ms, now_ms)  # never in the future
        tries = earlier.tries + 1 if earlier is not None else 0
        park = park_time(
            position=result.position,
            limit=sem.limit,
            hold=hold_times.estimate(task.name),
            tries=tries,
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
        longest = self._longest_park()
        if held_for >= longest or self._window_full():
            # The child decides, most often a retry: a new message (with a countdown, held as
            # an ETA task is), this one acknowledged, no longer holding a place in the window.
            _stamp_wait(req, first_ms)
            return None
        park = min(park, max(MIN_PARK, longest - held_for))
        asked = time.monotonic()
        again = attempt(sem, run, waiter_lease=park + config.waiter_margin, back_in=park)
        if isinstance(again, Permit):
            return again, asked
        self._park(_Parked(req, name, again.position, first_ms, tries, None, received_at), park)
        return None

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

    def _park_copy(self, req: Any, name: str, earlier: _Parked | None) -> None:
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
        self._park(_Parked(req, name, 0, first_ms, tries, None, received_at), MAX_PARK)

    def _longest_park(self) -> float:
        """How long one delivery may stay parked (unacknowledged): :data:`MAX_PARKED`, and at
        most half the broker's ``visibility_timeout`` (Redis, SQS), after which the broker
        would deliver the message again and a second copy of the task would run."""
        options = self.app.conf.broker_transport_options or {}
        visibility = options.get("visibility_timeout")
        if isinstance(visibility, bool) or not isinstance(visibility, int | float):
            return MAX_PARKED
        return min(MAX_PARKED, visibility / 2) if visibility > 0 else MAX_PARKED

    def _window(self) -> int:
        """The consumer's prefetch window (concurrency x prefetch multiplier; 0: unlimited)."""
        window = getattr(self.controller.consumer, "max_prefetch_count", 0)
        return window if isinstance(window, int) and window > 0 else 0

    def _widened(self) -> int:
        """How many parked tasks widened the prefetch window."""
        return sum(1 for p in self.parked.values() if p.qos is not None)

    def _may_widen_window(self) -> bool:
        """Whether parking one more task may widen the prefetch window (by one, as an ETA task
        does, so that the worker keeps fetching tasks it can run): at most a window's worth
        of parked tasks widen it, so that one busy key cannot make the worker reserve the
        whole queue behind it."""
        return self._widened() < self._window()  # never with prefetch unlimited (0)

    def _window_full(self) -> bool:
        """Whether a window's worth of parked tasks already widened the prefetch window, so
        that one more parked task would hold a place of the window itself. Then it goes to
        its child instead (which most often retries it through the broker): parked, it would
        keep the worker from fetching the tasks behind it in the queue, which may well be
        able to run, while pool slots sit idle."""
        return self._window() > 0 and not self._may_widen_window()

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
        waiting = [p for p in self.parked.values() if p.name == name and p.timer is not None]
        in_line = [p for p in waiting if p.first_ms >= 0]  # (copies of a running id are not)
        woken = [p for p in waiting if p.first_ms < 0 and permit_id_of(p.req) == ended_id]
        if in_line:
            woken.append(min(in_line, key=lambda p: p.position))
        for parked in woken:
            with suppress(Exception):
                self.controller.timer.cancel(parked.timer)
            self._resume(parked.req)

    # -- parking --------------------------------------------------------------------------

    def _park(self, parked: _Parked, seconds: float) -> None:
        controller = self.controller
        consumer = controller.consumer
        parked.connection = getattr(consumer, "connection", None)
        if self._may_widen_window():
            parked.qos = consumer.qos
            parked.qos.increment_eventually()  # as for an ETA task: keep fetching others
        self.parked[parked.req] = parked
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
            self.parked.pop(req, None)  # its message will be delivered again
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


def _received_at(req: Any, earlier: _Parked | None, now: float) -> float:
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
