"""Asking ahead: the permit of a task waiting for a pool slot is asked for before the slot frees.

Admission asks for a guarded task's permit when the task takes a pool slot
(:mod:`~celery_redsem.integration.admission.dispatcher`), so the ask's round trip, and the time the
worker's event loop takes to read its answer, would be slot time in which nothing runs: on a
busy host, several milliseconds per task. :class:`AskAhead` looks, on every turn of the event
loop, at the first :data:`ASK_AHEAD` task queued for a slot and has admission send its ask
right away. The answer is kept until the task takes its slot, and admission acts on it
then, exactly as on the answer to an ask sent at that moment (so a task is dispatched, parked
or made the standby only once it holds a slot). Tasks just handed to the pool come first: while
the pool has some not yet written to their children, the asks wait a turn of the loop, as that
turn's poll writes them (asks sent first would make every one of those tasks start later).

A task whose answer says it waits is parked from the queue without ever taking a slot
(:meth:`AskAhead.unqueue`). A parked task resuming while a slot is free is put first in the
queue and asked for at once (:meth:`AskAhead.ask_now`), so that no slot waits for its answer:
it takes a free slot once granted (:meth:`AskAhead.claim_slot`), else the next one.

What this costs: a permit granted ahead is held for the moments until a slot frees. So it is
asked for only while slots turn over quickly (one handed out within the last
:data:`SLOT_SOON` seconds, and about every ``SLOT_SOON / 2`` seconds of late), and only for
the first task in the queue. A grant still waiting for its slot after
:data:`HELD_FOR_AT_MOST` seconds is given back (a worker whose slots are held by long runs
keeps no permit idle), and so is a grant to a task that will not take a slot here (the broker
connection was lost, the worker stops: the slot queue is cleared): at once when the event
loop closes or resets, else within :data:`SWEEP_EVERY` seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from celery_redsem.integration.seam import SlotQueue

__all__ = [
    "ASK_AHEAD",
    "HELD_FOR_AT_MOST",
    "HELD_WAITING_FRESH",
    "SLOT_SOON",
    "SWEEP_EVERY",
    "AskAhead",
]

#: How many tasks at the head of the slot queue have their permits asked for ahead. One: the
#: grant of a second would be held idle for a whole slot turnover more, a permit a task of
#: the same key elsewhere could be running on (2 made the ``mixed`` benchmark slower).
ASK_AHEAD = 1
#: Asks go out ahead only while the worker hands out pool slots within this (seconds), and
#: on average about twice as often.
SLOT_SOON = 0.25
#: How often (seconds) asks of tasks gone from the slot queue, or kept too long, are looked for.
SWEEP_EVERY = 0.25
#: Seconds an answer to an ask sent ahead is kept for a task still waiting for its slot.
HELD_FOR_AT_MOST = 0.5
#: Seconds a "not granted" answer to an ask sent ahead stays good to act on when the task
#: takes its slot; an older one is asked again.
HELD_WAITING_FRESH = 0.25

A = TypeVar("A")


def _never() -> bool:
    return False


class AskAhead(Generic[A]):
    """Asks for the first tasks in a worker's slot queue, and keeps each ask until its task
    takes a slot (:meth:`take`).

    ``ask(req)`` sends an ask for ``req``, calling :meth:`sent` with what stands for it just
    before it sends (or does not: the task is asked for when it takes its slot);
    ``drop(asked)`` gives up an ask whose task will not take a slot here, or not within
    ``held_for_at_most`` seconds.
    """

    def __init__(
        self,
        ask: Callable[[Any], object],
        drop: Callable[[A], None],
        held_for_at_most: float = HELD_FOR_AT_MOST,
    ) -> None:
        self._ask = ask
        self._drop = drop
        #: By request: when it was asked for, and the ask (None: none was sent).
        self._asked: dict[Any, tuple[float, A | None]] = {}
        #: Requests granted while queued, waiting first in the slot queue (in grant order).
        self._claimed: set[Any] = set()
        self._slots: Any = None  # the worker's SlotQueue, once installed
        self._hub: Any = None
        self._held_for_at_most = held_for_at_most
        self._handed_at = 0.0  # when the latest slot was handed out (monotonic)
        self._gap = math.inf  # the average time between two slots handed out
        self._writes_pending: Callable[[], bool] = _never
        #: When asks were put off until the pool's writes are out (monotonic; 0.0: they are
        #: not). They go out at the start of the loop's next turn, once its poll returns: at
        #: once when a child can take a write, else at the next event or timer (the sweep's,
        #: within :data:`SWEEP_EVERY`); one still waiting after that is not waited for.
        self._put_off_at = 0.0

    def install(
        self, hub: Any, slots: SlotQueue, writes_pending: Callable[[], bool] = _never
    ) -> None:
        """Look at the queue of ``slots`` on every turn of ``hub`` (idempotent). While
        ``writes_pending()``
        (tasks handed to the pool and not yet written to their children), asks wait until
        those writes are out: the turn's poll returns at once for them, and asks sent first
        would delay every task the pool is about to start."""
        if self._hub is hub:
            return
        self._hub, self._slots = hub, slots
        self._writes_pending = writes_pending
        hub.on_tick.add(self._on_tick)
        hub.on_close.add(self._on_close)
        hub.timer.call_repeatedly(SWEEP_EVERY, self.sweep)

    def take(self, req: Any) -> A | None:
        """The ask sent ahead for ``req``, which is taking its slot now (None: there was none)."""
        now = time.monotonic()
        if self._handed_at:
            gap = now - self._handed_at
            self._gap = gap if math.isinf(self._gap) else 0.8 * self._gap + 0.2 * gap
        self._handed_at = now
        self._claimed.discard(req)
        return self._asked.pop(req, (now, None))[1]

    def _slots_free_soon(self) -> bool:
        """Whether pool slots are being handed out often enough to ask ahead."""
        return time.monotonic() - self._handed_at < SLOT_SOON and self._gap * 2 < SLOT_SOON

    def sent(self, req: Any, asked: A) -> None:
        """``ask`` is about to send ``asked`` for ``req``: from now on the task takes it with
        its slot, even if the slot comes before ``ask`` returns (an answer called back at once
        can free a slot, and the queue hands it over there and then)."""
        if req in self._asked:
            self._asked[req] = (self._asked[req][0], asked)

    def ask_now(self, req: Any) -> bool:
        """Ask for ``req`` now, whatever the slots do (a parked task resuming while a slot is
        free: it takes the slot once granted, see :meth:`claim_slot`); False if no ask went
        out (``req`` takes its slot and is asked for then)."""
        if self._slots is None:
            return False
        self._send(req)
        entry = self._asked.get(req)  # (gone: answered at once, and acted on)
        if entry is not None and entry[1] is None:  # nothing was sent
            del self._asked[req]
            return False
        return True

    def unsent(self, req: Any) -> None:
        """The ask for ``req`` registered with :meth:`sent` never went out: ``req`` is asked
        for when it takes its slot (none is waited for)."""
        entry = self._asked.get(req)
        if entry is not None:
            self._asked[req] = (entry[0], None)

    def claim_slot(self, req: Any) -> None:
        """``req``, queued for a slot, has its permit: if a slot is free it takes it now, else
        it goes first for the next slot given back (ahead of a parked task put first to be
        asked for: the permit is not held idle through one more turnover), behind the tasks
        granted before it that are first already (so grants take slots in the order given)."""
        slots = self._slots
        if slots is None or req in self._claimed:
            return
        if slots.free <= 0 and slots and slots.request_at(0) is req:
            self._claimed.add(req)  # first already
            return
        if not self.unqueue(req, forget=False):
            return
        if slots.free <= 0:
            slots.put_first(req, behind=self._granted_first())
            self._claimed.add(req)
            return
        slots.take(req)

    def _granted_first(self) -> int:
        """How many tasks at the head of the slot queue were granted and wait for a slot (a
        parked task woken since went in front of them: it is asked for first)."""
        count = 0
        for req in self._slots.first(len(self._claimed)):
            if req not in self._claimed:
                break
            count += 1
        return count

    def unqueue(self, req: Any, *, forget: bool = True) -> bool:
        """Take ``req`` out of the slot queue (``forget``: and its ask); False if not there."""
        self._claimed.discard(req)
        if forget:
            self._asked.pop(req, None)
        return self._slots is not None and self._slots.remove(req)

    def _send(self, req: Any) -> None:
        """Ask for ``req`` (once at most, whatever the outcome; ``ask`` calls :meth:`sent`
        before it sends)."""
        self._asked[req] = (time.monotonic(), None)
        self._ask(req)

    def _on_tick(self) -> None:
        if not self._slots or not self._slots_free_soon():
            return
        if self._put_off_at:
            if time.monotonic() - self._put_off_at < SWEEP_EVERY:
                return
            self._put_off_at = 0.0
        if self._writes_pending():
            self._put_off_at = time.monotonic()
            self._hub.call_soon(self._ask_after_writes)
            return
        self._ask_queued()

    def _ask_after_writes(self) -> None:
        """The asks put off by :meth:`_on_tick`, a turn of the loop later (the pool's writes
        went out in between); none if the loop closed meanwhile."""
        if not self._put_off_at:
            return
        self._put_off_at = 0.0
        if self._slots:
            self._ask_queued()

    def _ask_queued(self) -> None:
        for _ in range(ASK_AHEAD):  # (the queue is read afresh each time: an ask may move it)
            req = self._next_to_ask()
            if req is None:
                return
            self._send(req)

    def _next_to_ask(self) -> Any:
        """The first of the first :data:`ASK_AHEAD` tasks in the slot queue not asked for yet."""
        for req in self._slots.first(ASK_AHEAD):
            if req is not None and req not in self._asked:
                return req
        return None

    def sweep(self) -> None:
        """Give up the asks of requests no longer in the slot queue (it was cleared), and
        those kept for longer than :data:`HELD_FOR_AT_MOST` (asked again when slots free
        soon); then hand any free slot to the tasks queued for one."""
        if self._asked:
            self._sweep_asks()
        self._fill_free_slots()

    def _sweep_asks(self) -> None:
        queued = self._slots.queued_ids()
        too_old = time.monotonic() - self._held_for_at_most
        for req, (asked_at, asked) in list(self._asked.items()):
            if id(req) in queued and asked_at > too_old:
                continue
            del self._asked[req]
            self._claimed.discard(req)
            if asked is not None:
                self._drop(asked)

    def _fill_free_slots(self) -> None:
        """Hand free slots to the queue's head, unless it waits for the answer to its ask
        (a queued task is otherwise handed a slot only when one is given back)."""
        slots = self._slots
        while slots.free > 0 and slots:
            if slots.request_at(0) in self._asked:
                return  # takes a slot once granted
            slots.start_first()

    def _on_close(self, *_: Any) -> None:
        """The event loop closes or resets (a lost broker connection): every queued task's
        message will be delivered again, so every ask sent ahead is given up."""
        self._put_off_at = 0.0  # (asks put off until after the pool's writes: none now)
        self._claimed.clear()
        asked, self._asked = self._asked, {}
        for _asked_at, value in asked.values():
            if value is not None:
                self._drop(value)
