"""Parking in the worker's main process: the register of parked tasks, and the lot that parks
and resumes them.

:class:`ParkedTasks` keeps the parked requests by request and by semaphore name, so the wake-up
after a release and the guess of a newcomer's place look only at the tasks parked on that
semaphore. :class:`ParkingLot` parks a request (its pool slot given back, its message kept
unacknowledged, the prefetch window widened as for an ETA task: :mod:`.prefetch`) and, on its
timer or a wake-up, queues it first for the next slot. How long a task stays parked is
:mod:`~celery_redsem.integration.policy`'s arithmetic.

While any task is parked, a slot given back goes to the next task one event-loop step later:
the pool gives a finished task's slot back just before it calls the task's callbacks, so the
slot would go to the next task queued before admission hears of the run's end and wakes the
task parked first on its semaphore. One step later, that task is first in the queue.
"""

from __future__ import annotations

import heapq
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Protocol

from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.integration.admission.prefetch import widen_for_parked, window_step
from celery_redsem.integration.policy import MAX_PARK, longest_park
from celery_redsem.integration.seam import Slots, worker_stopping
from celery_redsem.metrics import record_park, record_unpark

__all__ = ["Parked", "ParkedTasks", "ParkingLot", "RateGuard", "received_at"]


class RateGuard(Protocol):
    """What admission asks of a rate guard: reserve the start of a run, and say how long it
    waits for it (0.0: none; None: its child decides)."""

    def wait_at_dispatch(
        self, app: Any, task: Any, request: Any, horizon: float
    ) -> float | None: ...


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
        self._by_run: dict[str, Parked] = {}  # in line, by permit id
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
        self._by_run[permit_id_of(parked.req)] = parked
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
        run = permit_id_of(req)
        if self._by_run.get(run) is parked:
            del self._by_run[run]
        if parked.first_ms < 0:
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

    def in_line(self, run: str) -> Parked | None:
        """The task parked in line under permit id ``run``, not resumed (None: none)."""
        parked = self._by_run.get(run)
        return parked if parked is not None and parked.timer is not None else None

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


class ParkingLot:
    """Parks requests in one worker: each gives its pool slot back, then asks again first in
    the slot queue, on its timer or when woken.

    ``slots`` are the worker's (:class:`~celery_redsem.integration.seam.Slots`);
    ``ask_first(req)``, if given, asks for a resuming task's permit while a slot is free,
    without taking the slot (False: nothing was asked, the task takes the slot and is asked
    for there). ``timer`` (default: the worker's) runs a parked task's resumption in the
    event loop.
    """

    def __init__(
        self,
        controller: Any,
        slots: Slots,
        ask_first: Any = None,
        hub: Any = None,
        timer: Any = None,
    ) -> None:
        self.controller = controller
        self.tasks = ParkedTasks()
        self.slots = slots
        self.timer = controller.timer if timer is None else timer
        self._ask_first = ask_first
        if hub is not None:
            slots.defer_releases(controller, hub, lambda: len(self.tasks) > 0)

    def stopping(self) -> bool:
        """Whether the worker is shutting down (its pool may run nothing more)."""
        return worker_stopping(self.controller)

    def park(self, parked: Parked, seconds: float, *, slot_taken: bool = True) -> None:
        """Park ``parked.req`` for ``seconds`` (its slot is given back, if it took one: a step
        later, as every slot while a task is parked, not now, when it would go to the next task
        at once)."""
        controller = self.controller
        consumer = controller.consumer
        parked.connection = getattr(consumer, "connection", None)
        parked.qos = consumer.qos
        # As for an ETA task: the window widens, so the worker keeps fetching others.
        widen_for_parked(parked.qos, 1, window_step(parked.connection))
        self.tasks.add(parked)
        record_park(getattr(parked.req, "name", None))
        parked.timer = self.timer.call_after(seconds, self.resume, (parked.req,), priority=6)
        if slot_taken:
            self.slots.give_back()

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
        slots = self.slots
        # First in the slot queue. With a slot free, its permit is asked for first: the slot
        # is taken once it is granted, and a task parked again never held one.
        slots.put_first(req)
        ask_first = self._ask_first
        if (
            slots.free > 0
            and not (ask_first is not None and ask_first(req))
            and slots.remove(req)  # (else handed its slot meanwhile)
        ):
            slots.take(req)

    def wake(self, parked: Parked) -> None:
        """Resume ``parked`` now, before its timer."""
        with suppress(Exception):
            self.timer.cancel(parked.timer)
        self.resume(parked.req)
