"""Admission on the gevent and eventlet pools: one dispatcher greenlet and slots of its own.

These pools have no event loop in the worker (their consumer reads messages in a plain loop)
and no slot semaphore: a task goes to ``Pool.spawn``, which blocks the consumer while the pool
is full. Admission there runs in one *dispatcher* greenlet, which owns everything admission
keeps: the consumer's hook only queues a task for it and returns, a task's end (reported in
the task's own greenlet) and a parked task's timer (in a greenlet of its own) queue their work
for it too. So nothing admission keeps changes while the dispatcher waits on Redis, which on
these pools is a plain (green) blocking call in that greenlet only.

:class:`GreenSlots` counts the pool's slots (its ``limit``): a task is handed to the pool only
with a slot, so ``spawn`` never waits for long; one that cannot run soon is parked, holding
none. :class:`GreenLoop` is the event loop admission expects (``call_soon``, ``call_after``).

A task's acknowledgement is sent by the dispatcher too, one at a time: on the Redis broker every
ack takes one of the channel's pooled connections (10 by default), and acks sent at once from
many task greenlets (a burst of tasks starting or ending together) run out of them, are lost,
and the broker delivers those tasks again.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from celery_redsem.integration.seam import call_once_when_run_ends

__all__ = ["SWEEP_EVERY", "GreenLoop", "GreenSlots", "green_library"]

logger = logging.getLogger(__name__)

#: Seconds between sweeps for a dead worker's messages (kombu's ``unacked_restore_interval``
#: default, on the Redis broker: see :func:`~celery_redsem.integration.seam.sweep_unacked`).
SWEEP_EVERY = 10.0


def green_library(pool: Any) -> str | None:
    """``"gevent"`` or ``"eventlet"`` if the worker's ``pool`` is Celery's pool of that name."""
    module = type(pool).__module__
    for name in ("gevent", "eventlet"):
        if module == f"celery.concurrency.{name}":
            return name
    return None


class GreenLoop:
    """The dispatcher greenlet's queue of work, as admission's event loop.

    ``call_soon(fn, *args)`` may be called from any greenlet of the worker's thread; ``fn``
    runs in the dispatcher, in order. ``call_after`` goes through the worker's (green) timer.
    """

    def __init__(self, library: str, timer: Any) -> None:
        self._timer = timer
        if library == "gevent":
            import gevent
            import gevent.queue

            self._queue: Any = gevent.queue.Queue()
            self._spawn: Callable[..., Any] = gevent.spawn
        else:
            import eventlet
            import eventlet.queue

            self._queue = eventlet.queue.LightQueue()
            self._spawn = eventlet.spawn
        self._dispatcher: Any = None
        #: Run after each piece of work (the broker poll's wake-up: see ``seam.PollWake``).
        self.after_work: Callable[[], None] = _nothing

    def start(self) -> None:
        """Start the dispatcher greenlet (once)."""
        if self._dispatcher is None:
            self._dispatcher = self._spawn(self._serve)

    def spawn(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in a greenlet of its own."""
        return self._spawn(fn, *args)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the dispatcher."""
        self._queue.put((fn, args))

    def call_after(
        self, seconds: float, fn: Callable[..., Any], args: tuple[Any, ...] = (), priority: int = 0
    ) -> Any:
        """Run ``fn(*args)`` in the dispatcher ``seconds`` from now (a timer entry; nothing
        cancels it: what it runs checks whether it still has anything to do)."""
        return self._timer.call_after(seconds, self.call_soon, (fn, *args), priority=priority)

    def run_pending(self) -> None:
        """Run what is queued for the dispatcher now, in the caller (a worker that stops:
        acknowledgements above all, before its connection closes)."""
        while True:
            try:
                fn, args = self._queue.get_nowait()
            except Exception:  # (the queue's Empty)
                return
            try:
                fn(*args)
            except Exception:
                logger.exception("celery_redsem: admission failed in the dispatcher's work")

    def cancel(self, _entry: Any) -> None:
        """Nothing: a timer's work checks, when it runs, whether it is still wanted."""

    def _serve(self) -> None:
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            except Exception:  # the dispatcher must go on: one task's failure is its own
                logger.exception("celery_redsem: admission failed in the dispatcher greenlet")
            try:
                self.after_work()
            except Exception:
                logger.exception("celery_redsem: waking the broker poll failed")


def _nothing() -> None:
    """Nothing to do."""


class GreenSlots:
    """The slots of a gevent or eventlet pool, counted here (the pool has no slot semaphore).

    The same interface as :class:`~celery_redsem.integration.seam.SlotQueue`: ``take`` runs
    ``process_task(req)`` with a slot at once if one is free, else queues ``req`` for the next
    one given back. Used only in the dispatcher greenlet.
    """

    gated_here = True

    def __init__(self, size: int, process_task: Callable[[Any], Any], loop: GreenLoop) -> None:
        self._free = size
        self._queued: deque[Any] = deque()
        self._start = process_task
        self._loop = loop

    @property
    def free(self) -> int:
        """How many slots are free now."""
        return self._free

    def take(self, req: Any) -> None:
        """``req`` takes a slot: now if one is free, else when one is given back."""
        if self._free > 0:
            self._free -= 1
            self._start(req)
        else:
            self._queued.append(req)

    def give_back(self) -> None:
        """Give a slot back: to the first task queued for one, if any."""
        if self._queued:
            self._start(self._queued.popleft())
        else:
            self._free += 1

    def give_back_at_end(self, req: Any) -> None:
        """Give ``req``'s slot back when its run ends (in the dispatcher), and have the
        dispatcher send its acknowledgement (see the module docstring)."""
        call_once_when_run_ends(req, lambda: self._loop.call_soon(self.give_back))
        acknowledge = req.acknowledge
        req.acknowledge = lambda: self._loop.call_soon(acknowledge)

    def __bool__(self) -> bool:
        """Whether any task waits for a slot."""
        return bool(self._queued)

    def request_at(self, index: int) -> Any:
        """The request queued at ``index`` (0: first)."""
        return self._queued[index]

    def first(self, count: int) -> Iterator[Any]:
        """The first ``count`` requests queued."""
        for index in range(min(count, len(self._queued))):
            yield self._queued[index]

    def queued_ids(self) -> set[int]:
        """The ``id()`` of every request queued for a slot."""
        return {id(req) for req in self._queued}

    def put_first(self, req: Any, *, behind: int = 0) -> None:
        """Queue ``req`` for the next slot given back, behind the first ``behind`` queued."""
        self._queued.insert(behind, req)

    def remove(self, req: Any) -> bool:
        """Take ``req`` out of the queue; False if it was not there."""
        for index, queued in enumerate(self._queued):
            if queued is req:
                del self._queued[index]
                return True
        return False

    def start_first(self) -> None:
        """Give a free slot to the first task queued."""
        self.take(self._queued.popleft())

    def defer_releases(self, controller: Any, hub: Any, while_: Callable[[], bool]) -> None:
        """Nothing to defer: a slot comes back through the dispatcher's queue already, after
        the run's end has woken the task parked first on its semaphore."""
