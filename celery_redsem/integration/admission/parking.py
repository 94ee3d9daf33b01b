"""Parking in the worker: how long a task parked by admission waits, the register of parked
tasks, and the slot it gives back and takes again.

:func:`park_time` turns a place in line into the time the task asks again: about when the
holders ahead of it have left, a little early, so a deep line costs a task O(1) round trips
(a release here wakes the first parked task sooner). :class:`ParkedTasks` keeps the parked
requests by request and by semaphore name, so the wake-up after a release and the guess of a
newcomer's place look only at the tasks parked on that semaphore. :class:`ParkingLot` gives a
parked task's pool slot back and, on its timer or a wake-up, queues it first for the next one.
"""

from __future__ import annotations

import heapq
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state
from kombu.transport.virtual import Transport as VirtualTransport

from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.integration.guards.rate_guard import RateGuard
from celery_redsem.metrics import record_park, record_unpark

__all__ = [
    "EARLY",
    "FIRST_PARK",
    "MAX_PARK",
    "MAX_PARKED",
    "MAX_PARKED_TASKS",
    "MIN_PARK",
    "WINDOW_STEP",
    "Parked",
    "ParkedTasks",
    "ParkingLot",
    "first_ask",
    "longest_park",
    "park_time",
    "received_at",
    "slot_semaphore",
    "widen_for_parked",
    "window_step",
]

#: Bounds on how long a parked task waits before it asks again (the upper one while no hold
#: time of its task is known; after that, its turn as the line moves, up to its longest park).
MIN_PARK = 0.002
MAX_PARK = 1.0
#: Until a hold time of its task is known, a parked task asks again after this, doubling.
FIRST_PARK = 0.01
#: A parked task asks again a little before its turn is expected.
EARLY = 0.8
#: Seconds after its delivery a task may still be parked; then its child retries it through
#: the broker. (Well inside the brokers' own limits: Redis' default visibility timeout is an
#: hour, RabbitMQ's consumer timeout 30 minutes.)
MAX_PARKED = 300.0
#: At most this many tasks are parked per worker; more go to their pool child.
MAX_PARKED_TASKS = 10_000


def park_time(
    *, position: int, limit: int, hold: float | None, tries: int, longest: float = MAX_PARKED
) -> float:
    """Seconds a parked task at ``position`` waits before asking again (at most ``longest``).

    About when ``position`` holders of ``hold`` seconds have left a ``limit`` semaphore: a
    little early near the head of the line, a round of holders early further back; until a
    hold time is known, :data:`FIRST_PARK` doubling with each try, up to
    :data:`MAX_PARK`. A task woken by a release here asks sooner.
    """
    if hold is None:  # a round of holders at a time, doubling
        rounds = max(1, position // limit)
        return min(MAX_PARK, longest, rounds * FIRST_PARK * 2.0 ** min(tries, 32))
    # Near the head, a little before its turn; deeper, when about a round of holders is left
    # ahead of it (asking earlier only costs a round trip: releases here wake the first anyway).
    rounds_ahead = max(EARLY * position, position - limit)
    return min(longest, max(MIN_PARK, rounds_ahead * hold / limit))


def first_ask(
    present_lease: float,
    margin: float,
    *,
    limit: int,
    behind: int | None,
    hold: float | None,
    longest: float,
) -> tuple[float, float]:
    """The waiter lease and ``back_in`` of a task's first ask: present (``present_lease``,
    no ``back_in``), or, arriving behind tasks parked here on its semaphore (the last at place
    ``behind``), away for about as long as the one place after theirs waits, its place kept
    ``margin`` beyond: one call both asks and tells Redis when it will be back (until then its
    place holds no free permit for it)."""
    if behind is None:
        return present_lease, 0.0
    back_in = park_time(position=behind + 1, limit=limit, hold=hold, tries=0, longest=longest)
    return back_in + margin, back_in


def longest_park(conf: Any) -> float:
    """How long one delivery may stay parked (unacknowledged): :data:`MAX_PARKED`, and at most
    half the broker's ``visibility_timeout`` (Redis, SQS) in the app's ``conf``, after which
    the broker would deliver the message again and a second copy of the task would run."""
    options = conf.broker_transport_options or {}
    visibility = options.get("visibility_timeout")
    if isinstance(visibility, bool) or not isinstance(visibility, int | float):
        return MAX_PARKED
    return min(MAX_PARKED, visibility / 2) if visibility > 0 else MAX_PARKED


def received_at(req: Any, earlier: Parked | None, now: float) -> float:
    """When ``req``'s delivery reached the worker (monotonic): as parked before (``earlier``),
    else as its :class:`~celery_redsem.integration.worker.hooks.ReleasingRequest` noted, else
    ``now``."""
    if earlier is not None:
        return earlier.received_at
    received = getattr(req, "redsem_received_at", None)
    return received if isinstance(received, float) else now


@dataclass
class Parked:
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


class ParkedTasks:
    """The requests parked in one worker, by request and by semaphore name.

    A line 1,000 deep is parked in one worker, and every release, dispatch and newcomer asks
    who is first or last in it, so those answers do not walk the line: the first waiting task
    comes off a heap (entries left by tasks resumed or gone are dropped as they surface; a
    place never changes once parked, and a task parked again is a new entry), the
    deepest place is kept as tasks are parked, and copies of a running run are found by its
    permit id.
    """

    def __init__(self) -> None:
        self._by_req: dict[Any, Parked] = {}
        self._by_name: dict[str, dict[Any, Parked]] = {}
        self._heads: dict[str, list[tuple[int, int, Parked]]] = {}  # heap per name
        self._deepest: dict[str, int] = {}  # per name; absent: to be found again
        self._copies: dict[str, list[Parked]] = {}  # by permit id (waiting for a run)
        self._pushed = 0  # breaks ties between equal places: the earlier parked first

    def __len__(self) -> int:
        return len(self._by_req)

    def __contains__(self, req: object) -> bool:
        return req in self._by_req

    def get(self, req: Any) -> Parked | None:
        """How ``req`` is parked, or None."""
        return self._by_req.get(req)

    def add(self, parked: Parked) -> None:
        """Register ``parked`` (two deliveries of one task id are parked apart)."""
        name = parked.name
        self._by_req[parked.req] = parked
        self._by_name.setdefault(name, {})[parked.req] = parked
        if parked.first_ms < 0:  # a copy of a running run, not in line
            self._copies.setdefault(permit_id_of(parked.req), []).append(parked)
            return
        self._pushed += 1
        heapq.heappush(self._heads.setdefault(name, []), (parked.position, self._pushed, parked))
        if name in self._deepest:
            self._deepest[name] = max(self._deepest[name], parked.position)

    def remove(self, req: Any) -> Parked | None:
        """Forget ``req``, if it was parked; how it was."""
        parked = self._by_req.pop(req, None)
        if parked is None:
            return None
        name = parked.name
        same_name = self._by_name.get(name, {})
        same_name.pop(req, None)
        if not same_name:
            self._by_name.pop(name, None)
            self._heads.pop(name, None)
        elif len(self._heads.get(name, ())) > 2 * len(same_name) + 16:
            # Mostly entries of tasks gone or parked again: keep only the live ones.
            live = []
            for kept in same_name.values():
                if kept.first_ms >= 0:
                    self._pushed += 1
                    live.append((kept.position, self._pushed, kept))
            heapq.heapify(live)
            self._heads[name] = live
        if self._deepest.get(name) == parked.position:
            self._deepest.pop(name)  # the deepest left: found again when asked
        if parked.first_ms < 0:
            run = permit_id_of(req)
            copies = [p for p in self._copies.get(run, ()) if p is not parked]
            if copies:
                self._copies[run] = copies
            else:
                self._copies.pop(run, None)
        return parked

    def first_in_line(self, name: str) -> Parked | None:
        """The task parked on ``name`` first in its line, not resumed yet (None: none).
        (Copies of a running run wait for that run, not in line.)"""
        heap = self._heads.get(name)
        while heap:
            parked = heap[0][2]
            if parked.timer is not None and self._by_name[name].get(parked.req) is parked:
                return parked
            heapq.heappop(heap)  # resumed or gone (a task parked again has an entry of its own)
        return None

    def copies_of(self, run: str, name: str) -> list[Parked]:
        """Copies of run ``run`` (permit id) on ``name`` parked until it ends, not resumed."""
        return [p for p in self._copies.get(run, ()) if p.timer is not None and p.name == name]

    def deepest_position(self, name: str) -> int | None:
        """The last place in line known of the tasks parked on ``name`` (None: none)."""
        parked = self._by_name.get(name)
        if not parked:
            return None
        deepest = self._deepest.get(name)
        if deepest is None:
            deepest = self._deepest[name] = max(p.position for p in parked.values())
        return deepest


_UNKNOWN = object()
_BLUEPRINT_RUNNING: int = bootsteps.RUN  # type: ignore[attr-defined]  # (not in the stubs)


class ParkingLot:
    """Parks requests in one prefork worker: each gives its pool slot back, then asks again
    first in the slot queue, on its timer or when woken.

    ``process_task`` is what a slot is taken for (admission's hook); ``ask_first(req)``, if
    given, asks for a resuming task's permit while a slot is free, without taking the slot
    (False: nothing was asked, the task takes the slot and is asked for there).
    """

    def __init__(
        self,
        controller: Any,
        process_task: Callable[[Any], Any],
        ask_first: Callable[[Any], bool] | None = None,
    ) -> None:
        self.controller = controller
        self.tasks = ParkedTasks()
        self._process_task = process_task
        self._ask_first = ask_first
        self._slots: Any = _UNKNOWN

    def stopping(self) -> bool:
        """Whether the worker is shutting down (its pool may run nothing more)."""
        for flag in (worker_state.should_stop, worker_state.should_terminate):
            if flag is not None and flag is not False:  # an exit code, 0 included
                return True
        blueprint = getattr(self.controller, "blueprint", None)
        state: object = getattr(blueprint, "state", _BLUEPRINT_RUNNING)
        return state != _BLUEPRINT_RUNNING

    @property
    def slots(self) -> Any:
        """The worker's slot semaphore (None: its pool has none, so nothing is parked),
        looked up when the worker first dispatches (the pool makes it as it starts). While
        tasks are parked, it gives slots back a step later (:func:`release_after_callbacks`)."""
        if self._slots is _UNKNOWN:
            self._slots = slot_semaphore(self.controller)
            hub = getattr(self.controller, "hub", None)
            if self._slots is not None and hub is not None:
                release_after_callbacks(self._slots, hub, self.tasks)
        return self._slots

    def park(self, parked: Parked, seconds: float, *, slot_taken: bool = True) -> None:
        """Park ``parked.req`` for ``seconds`` (its slot is given back, if it took one)."""
        controller = self.controller
        consumer = controller.consumer
        parked.connection = getattr(consumer, "connection", None)
        parked.qos = consumer.qos
        # As for an ETA task: the window widens, so the worker keeps fetching others.
        widen_for_parked(parked.qos, 1, window_step(parked.connection))
        self.tasks.add(parked)
        record_park(parked.req)
        parked.timer = controller.timer.call_after(seconds, self.resume, (parked.req,), priority=6)
        if slot_taken:
            self.give_back_slot()

    def park_copy(self, req: Any, name: str, earlier: Parked | None) -> None:
        """Park a second delivery of a task run running here until that run ends.

        The permit is the run's, so this copy would get it too, and the first run's end
        would release it under the second: the two would run at once, and a third task could
        join them. Parked, it asks again when that run ends, so the copies run one after the
        other, as at-least-once delivery does. (Parked past half the broker's visibility
        timeout, it may be delivered once more: that copy waits its turn too.)
        """
        tries = earlier.tries if earlier is not None else 0  # not a try for a permit
        first_ms = earlier.first_ms if earlier is not None else -1  # not waiting for a permit
        delivered = received_at(req, earlier, time.monotonic())
        self.park(Parked(req, name, 0, first_ms, tries, None, delivered), MAX_PARK)

    def admit_rate(self, app: Any, req: Any, guard: RateGuard, earlier: Parked | None) -> None:
        """A task whose only guard is a rate limit: dispatched once its limiter admits it,
        else parked until exactly the start booked for it (no pool slot, no broker trip)."""
        delivered = received_at(req, earlier, time.monotonic())
        horizon = longest_park(app.conf) - (time.monotonic() - delivered)
        wait = guard.wait_at_dispatch(app, req.task, req, horizon)
        if wait:  # 0.0: admitted; None: its child decides
            self.park_for_rate(req, earlier, delivered, wait)

    def park_for_rate(
        self, req: Any, earlier: Parked | None, delivered: float, seconds: float
    ) -> None:
        """Park a rate-limited task until the start booked for it, ``seconds`` from now."""
        tries = earlier.tries + 1 if earlier is not None else 0
        # Under a name no semaphore can have (names have no braces): no release wakes it.
        self.park(Parked(req, "{rate}", 0, 0, tries, None, delivered), seconds)

    def give_back_slot(self) -> None:
        """Give back the pool slot taken for a request just parked: a step later, as every
        slot while a task is parked (not now: it would go to the next task at once)."""
        semaphore = self.slots
        assert semaphore is not None
        semaphore.release()

    def resume(self, req: Any) -> None:
        """``req`` asks again, first in the slot queue."""
        parked = self.tasks.get(req)
        if parked is None or parked.timer is None:
            return
        parked.timer = None  # resumed once: a later timer or wake-up does nothing
        consumer = self.controller.consumer
        # Give back the prefetch it took from the window it was counted in, if it took one
        # (after a reconnection the consumer has a new window, which never counted it).
        if parked.qos is not None:
            widen_for_parked(parked.qos, -1, window_step(parked.connection))
        if self.stopping() or getattr(consumer, "connection", None) is not parked.connection:
            record_unpark(parked)
            self.tasks.remove(req)  # its message will be delivered again
            return
        semaphore = self.slots
        assert semaphore is not None
        # First in the slot queue. With a slot free, its permit is asked for first: the slot
        # is taken once it is granted, and a task parked again never held one.
        queued: tuple[Any, tuple[Any], dict[str, Any]] = (self._process_task, (req,), {})
        semaphore._waiting.appendleft(queued)
        if semaphore.value > 0 and (self._ask_first is None or not self._ask_first(req)):
            try:
                semaphore._waiting.remove(queued)
            except ValueError:  # (handed its slot meanwhile)
                return
            semaphore.acquire(self._process_task, req)

    def wake(self, parked: Parked) -> None:
        """Resume ``parked`` now, before its timer."""
        with suppress(Exception):
            self.controller.timer.cancel(parked.timer)
        self.resume(parked.req)


#: On a broker that keeps the prefetch window itself (RabbitMQ), the window widens for parked
#: tasks this many messages at a time, and narrows back a step at a time (all of the way once
#: none is parked): each change is a ``basic.qos`` round trip in the event loop, which one
#: change per parked task would spend on every task of a deep line. Where kombu keeps the
#: window in the worker (Redis, SQS: no round trip), it follows the parked tasks one by one.
WINDOW_STEP = 8

_widened: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def window_step(connection: Any) -> int:
    """How many messages at a time the prefetch window of ``connection`` changes for parked
    tasks: 1 on kombu's virtual transports, :data:`WINDOW_STEP` on the others."""
    transport = getattr(connection, "transport", None)
    return 1 if transport is None or isinstance(transport, VirtualTransport) else WINDOW_STEP


def widen_for_parked(qos: Any, change: int, step: int) -> None:
    """One more (``change`` 1) or one fewer (-1) task parked on the consumer's prefetch window
    ``qos`` (a kombu ``QoS``): widen or narrow it in ``step``s, so that it holds the parked
    tasks and as many messages beside them as before (up to ``2 * step - 2`` more)."""
    counts = _widened.setdefault(qos, [0, 0])  # tasks parked on it, messages it was widened
    counts[0] = parked = max(0, counts[0] + change)
    widened = counts[1]
    if parked > widened:
        change = step
    elif parked == 0 and widened:
        change = -widened
    elif widened - parked >= 2 * step - 1:
        change = -step
    else:
        return
    before = qos.value
    if change > 0:
        qos.increment_eventually(change)  # (kombu caps it at the worker's eta task limit)
    else:
        qos.decrement_eventually(-change)  # (and never below 1)
    counts[1] = widened + (qos.value - before if before else change)


def slot_semaphore(controller: Any) -> Any:
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


def release_after_callbacks(slots: Any, hub: Any, tasks: ParkedTasks) -> None:
    """While any task is parked (in ``tasks``), the pool gives a finished task's slot back
    one event-loop step later.

    The pool gives the slot back just before it calls the task's callbacks; the slot would go
    to the next task queued for one before admission hears of the run's end and wakes the
    task parked first on its semaphore, which then waits for the slot after. One step later,
    the woken task is first in the queue (:meth:`ParkingLot.resume`) and takes this slot.
    """
    if getattr(slots, "_redsem_deferred", False):
        return
    release = slots.release

    def release_soon() -> None:
        if len(tasks):
            hub.call_soon(release)
        else:
            release()

    slots.release = release_soon
    slots._redsem_deferred = True
