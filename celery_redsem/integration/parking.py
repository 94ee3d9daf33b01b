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

from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from celery_redsem.integration.metrics import record_park, record_unpark

__all__ = [
    "EARLY",
    "FIRST_PARK",
    "MAX_PARK",
    "MAX_PARKED",
    "MAX_PARKED_TASKS",
    "MIN_PARK",
    "Parked",
    "ParkedTasks",
    "ParkingLot",
    "first_ask",
    "longest_park",
    "park_time",
    "received_at",
    "slot_semaphore",
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
    else as its :class:`~celery_redsem.integration.worker.ReleasingRequest` noted, else ``now``."""
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
    """The requests parked in one worker, by request and by semaphore name."""

    def __init__(self) -> None:
        self._by_req: dict[Any, Parked] = {}
        self._by_name: dict[str, dict[Any, Parked]] = {}

    def __len__(self) -> int:
        return len(self._by_req)

    def __contains__(self, req: object) -> bool:
        return req in self._by_req

    def get(self, req: Any) -> Parked | None:
        """How ``req`` is parked, or None."""
        return self._by_req.get(req)

    def add(self, parked: Parked) -> None:
        """Register ``parked`` (two deliveries of one task id are parked apart)."""
        self._by_req[parked.req] = parked
        self._by_name.setdefault(parked.name, {})[parked.req] = parked

    def remove(self, req: Any) -> Parked | None:
        """Forget ``req``, if it was parked; how it was."""
        parked = self._by_req.pop(req, None)
        if parked is not None:
            same_name = self._by_name.get(parked.name, {})
            same_name.pop(req, None)
            if not same_name:
                self._by_name.pop(parked.name, None)
        return parked

    def on(self, name: str) -> list[Parked]:
        """The tasks parked on semaphore ``name``."""
        return list(self._by_name.get(name, {}).values())

    def first_in_line(self, name: str) -> Parked | None:
        """The task parked on ``name`` first in its line, not resumed yet (None: none).
        (Copies of a running task run wait for that run, not in line.)"""
        waiting = [p for p in self.on(name) if p.timer is not None and p.first_ms >= 0]
        return min(waiting, key=lambda p: p.position) if waiting else None

    def deepest_position(self, name: str) -> int | None:
        """The last place in line known of the tasks parked on ``name`` (None: none)."""
        parked = self._by_name.get(name)
        if not parked:
            return None
        return max(p.position for p in parked.values())


_UNKNOWN = object()


class ParkingLot:
    """Parks requests in one prefork worker: each gives its pool slot back, then asks again
    first in the slot queue, on its timer or when woken.

    ``stopping`` says whether the worker is shutting down; ``process_task`` is what a slot is
    taken for (admission's hook).
    """

    def __init__(
        self, controller: Any, stopping: Callable[[], bool], process_task: Callable[[Any], Any]
    ) -> None:
        self.controller = controller
        self.tasks = ParkedTasks()
        self._stopping = stopping
        self._process_task = process_task
        self._slots: Any = _UNKNOWN

    @property
    def slots(self) -> Any:
        """The worker's slot semaphore (None: its pool has none, so nothing is parked),
        looked up when the worker first dispatches (the pool makes it as it starts)."""
        if self._slots is _UNKNOWN:
            self._slots = slot_semaphore(self.controller)
        return self._slots

    def park(self, parked: Parked, seconds: float) -> None:
        """Park ``parked.req`` for ``seconds`` (its slot is given back)."""
        controller = self.controller
        consumer = controller.consumer
        parked.connection = getattr(consumer, "connection", None)
        parked.qos = consumer.qos
        parked.qos.increment_eventually()  # as for an ETA task: keep fetching others
        self.tasks.add(parked)
        record_park(parked.req)
        parked.timer = controller.timer.call_after(seconds, self.resume, (parked.req,), priority=6)
        self.give_back_slot()

    def give_back_slot(self) -> None:
        """Give back the pool slot taken for a request that does not go to the pool now."""
        semaphore = self.slots
        assert semaphore is not None
        hub = getattr(self.controller, "hub", None)
        if hub is not None:  # not now: release() may hand the slot to the next task at once
            hub.call_soon(semaphore.release)
        else:
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
            parked.qos.decrement_eventually()
        if self._stopping() or getattr(consumer, "connection", None) is not parked.connection:
            record_unpark(parked)
            self.tasks.remove(req)  # its message will be delivered again
            return
        semaphore = self.slots
        assert semaphore is not None
        if semaphore.value > 0:
            semaphore.acquire(self._process_task, req)
        else:
            semaphore._waiting.appendleft((self._process_task, (req,), {}))

    def wake(self, parked: Parked) -> None:
        """Resume ``parked`` now, before its timer."""
        with suppress(Exception):
            self.controller.timer.cancel(parked.timer)
        self.resume(parked.req)


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
