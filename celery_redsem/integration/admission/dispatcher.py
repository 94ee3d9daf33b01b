"""Admission at dispatch: a prefork worker gives a pool slot only to a task that has its permit.

The prefork pool's main process hands a task to a child only when one of its slots is free
(Celery's slot semaphore). For a task with one guard, :class:`Admission` asks for the permit
(joining the FIFO line under the run's permit id) without the event loop waiting for the
reply (:mod:`.asks`), and for the first tasks queued for a slot before the slot frees
(:mod:`.ask_ahead`). Once the task holds its slot and the answer is there:

* **Granted**: the task goes to the child with the permit (:mod:`.handoff`).
* **Next in line**, with a spare slot: the task waits in its child as the semaphore's
  *standby* for the release (:mod:`.standby`).
* **Not granted**: the task is *parked* here, unacknowledged, and its slot goes to the next
  task (:mod:`.parking`): no slot time, no trip through the broker. Its place holds no free
  permit while it is away (``back_in``); it asks again when its turn is expected, or at once
  when a run of the same semaphore ends here.

A task that waits never takes a slot when it can be helped: one asked for ahead of its slot is
parked straight from the slot queue, and a parked task resuming while a slot is free is asked
for first and takes the slot only once granted (or when it must go to its child).

A deep line costs a task O(1) round trips, and tasks for other keys queued behind a burst
reach a free slot at once. Past the parking's bounds (:data:`.parking.MAX_PARKED` seconds
from delivery, half the broker's ``visibility_timeout``, :data:`.parking.MAX_PARKED_TASKS`
tasks) or ``redsem_max_wait``, a task goes to its child, which retries it through the broker
or fails it with :class:`~celery_redsem.AcquireTimeout`. If the worker stops or loses its
broker connection, the broker delivers the parked messages again (never run twice here).
The key function runs in the event loop; one too slow for that is left to the children.

Anything unusual hands the task to its child unchanged, which waits or retries as
:mod:`.retrying` describes: pools without a slot semaphore (solo, threads, gevent,
eventlet), several guards, a key function that fails, ``min_replicas`` (its ``WAIT`` would
stall the event loop), a worker shutting down, and Redis errors (admission pauses, see
:mod:`.gate`).
``redsem_worker_admission = False`` turns it off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from celery import Celery

from celery_redsem.core.errors import BackendError
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit, Waiting
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.integration.admission.ask_ahead import (
    HELD_WAITING_FRESH,
    AskAhead,
    unwritten_tasks,
)
from celery_redsem.integration.admission.asks import Answer, Asks, WaitingAsks, asks_for
from celery_redsem.integration.admission.gate import Gate
from celery_redsem.integration.admission.live_runs import LiveRuns
from celery_redsem.integration.admission.parking import (
    MAX_PARKED_TASKS,
    MIN_PARK,
    Parked,
    ParkingLot,
    first_ask,
    longest_park,
    park_time,
    received_at,
)
from celery_redsem.integration.admission.standby import (
    GrantNotices,
    Standbys,
    clear_standby,
    mark_standby,
)
from celery_redsem.integration.guards.naming import call_arguments
from celery_redsem.integration.guards.rate_guard import RateGuard
from celery_redsem.integration.guards.semaphore_guard import TaskGuard
from celery_redsem.integration.line import (
    present_waiter_lease,
    read_wait_of,
    release_quietly,
    server_ms,
    stamp_wait_began,
)
from celery_redsem.integration.policy import hold_times
from celery_redsem.integration.settings import RedsemConfig, get_client, get_config
from celery_redsem.integration.wire import clear_grant, hand_over
from celery_redsem.metrics import record_admission_grant, record_unpark

__all__ = ["Admission", "install_admission"]

logger = logging.getLogger(__name__)


@dataclass
class _Asking:
    """A guarded request whose permit admission is asking for, until it is dispatched or parked."""

    req: Any
    guard: TaskGuard
    earlier: Parked | None  # how it was parked before, if it was
    sem: FairSemaphore
    run: str  # its permit id
    config: RedsemConfig
    hold: float | None  # the hold time learnt for its task
    longest: float  # how long its delivery may stay parked
    connection: Any  # the consumer's broker connection when it was asked for
    lease: float = 0.0  # the waiter lease and back_in of the latest ask
    back_in: float = 0.0
    asked: float = 0.0  # monotonic time of the latest ask
    settled: bool = False
    slotted: bool = True  # False while asked ahead of its slot (:mod:`.ahead`)
    dropped: bool = False  # asked ahead, for a task that will not take a slot here
    held: tuple[_Then, Answer, float] | None = None  # an answer kept until it takes its slot


#: What acts on the answer to an ask (once the task holds its slot).
_Then = Callable[[_Asking, Permit | Waiting], None]


class Admission:
    """Asks for the permit of a guarded task when a pool slot is free; parks it if none is."""

    def __init__(self, controller: Any, app: Celery) -> None:
        self.controller = controller
        self.app = app
        self._dispatch = controller._process_task  # the worker's own: hands to the pool
        self.ahead: AskAhead[_Asking] = AskAhead(self._ask_ahead, self._drop_ahead)
        self.lot = ParkingLot(controller, self.process_task, self.ahead.ask_now)
        self.parked = self.lot.tasks  # parked requests, by request and by semaphore name
        self.runs = LiveRuns(on_end=self._wake_one)  # runs asked for or handed over here
        self.standbys = Standbys()
        self.notices = GrantNotices()
        self._asks: Asks | None = None
        self.gate = Gate()  # which tasks admission decides for; its pause after an error

    # -- the hook -------------------------------------------------------------------------

    def process_task(self, req: Any) -> Any:
        """Stands in for the worker's ``_process_task``: called with a slot taken for ``req``."""
        asked_ahead = self.ahead.take(req)
        earlier = self.parked.remove(req)
        record_unpark(earlier)
        clear_grant(req.request_dict)
        clear_standby(req.request_dict)
        if asked_ahead is not None and self._took_slot(asked_ahead):
            return None  # its answer is acted on now, or when it comes
        if self.lot.stopping():  # a grant now might never run here: the child asks, if it runs
            return self._dispatch(req)
        guard = self._guard_to_admit(req)
        if guard is None:
            return self._dispatch(req)
        try:
            if isinstance(guard, RateGuard):
                self.lot.admit_rate(self.app, req, guard, earlier)
                self.gate.answered()
            elif self._ask(req, guard, earlier):
                return None  # answered later (or already): dispatched or parked then
        except BackendError as exc:
            self.gate.pause(exc)
        except Exception:  # never lose a task to a bug here: the child decides
            logger.exception("celery_redsem: admission failed for %s[%s]", req.name, req.id)
        if req in self.parked:
            return None
        return self._dispatch(req)

    def _guard_to_admit(self, req: Any) -> TaskGuard | RateGuard | None:
        """The one guard of ``req``'s task if admission decides for it, else None (so for
        every task in a pool without a slot semaphore: solo, threads, gevent, eventlet)."""
        return None if self.lot.slots is None else self.gate.guard_of(req)

    # -- asking ---------------------------------------------------------------------------

    def _ask(
        self, req: Any, guard: TaskGuard, earlier: Parked | None, *, ahead: bool = False
    ) -> _Asking | bool:
        """Ask for ``req``'s permit; False if its child should decide instead (dispatch it).

        When the answer comes, ``req`` is dispatched with the permit, parked (its slot given
        back), or dispatched without one for its child to decide (:meth:`_answered`); asked
        ``ahead`` of its slot, only once it takes the slot (:meth:`_took_slot`).
        """
        task = req.task
        config = get_config(self.app)
        started = time.monotonic()
        try:
            name, limit = guard.name_and_limit(
                task.name, call_arguments(task, req.args), req.kwargs or {}
            )
        except Exception:  # the child reports a bad key (or limit) function, visibly
            return False
        finally:
            self.gate.slow_keys.timed(task.name, time.monotonic() - started)
        sem = guard.semaphore(self.app, name, config, limit)
        if sem.min_replicas:
            return False
        run = permit_id_of(req)
        if self.runs.runs_here(req, run):
            if ahead:
                return False  # parked as a copy when it takes its slot
            self.lot.park_copy(req, name, earlier)
            return True
        hold = hold_times.estimate(task.name)
        longest = longest_park(self.app.conf)
        connection = getattr(self.controller.consumer, "connection", None)
        asking = _Asking(req, guard, earlier, sem, run, config, hold, longest, connection)
        asking.slotted = not ahead
        behind = None if earlier is not None else self.parked.deepest_position(name)
        lease, back_in = first_ask(
            present_waiter_lease(config),
            config.waiter_margin,
            limit=sem.limit,
            behind=behind,
            hold=hold,
            longest=longest,
        )
        if ahead:
            if not back_in:  # away until its slot: its place holds no free permit meanwhile
                back_in = HELD_WAITING_FRESH
                lease = back_in + config.waiter_margin
            self.ahead.sent(req, asking)
        self._send(asking, lease, back_in, self._answered)
        return asking

    def _ask_ahead(self, req: Any) -> None:
        """Ask for the permit of ``req``, queued for a slot (:mod:`.ahead`), if it should be."""
        try:
            guard = None if self.lot.stopping() else self._guard_to_admit(req)
            if isinstance(guard, TaskGuard):
                self._ask(req, guard, self.parked.get(req), ahead=True)
        except Exception:  # asked when it takes its slot, which reports what failed
            logger.debug("celery_redsem: no ask ahead for %s", req, exc_info=True)

    def _took_slot(self, asking: _Asking) -> bool:
        """``asking``'s task, asked for ahead, took its slot: act on the answer now if it came
        (False: too old to act on, ask again), else when it comes."""
        asking.slotted = True
        if asking.held is None:
            return True
        (then, answer, at), asking.held = asking.held, None
        fresh = HELD_WAITING_FRESH if isinstance(answer, Waiting) else asking.sem.lease / 3
        if time.monotonic() - at > fresh:
            self.runs.answered(asking.run, asking.req)  # (asked again: a grant is renewed)
            return False
        self._on_answer(asking, then, answer)
        return True

    def _drop_ahead(self, asking: _Asking) -> None:
        """``asking``'s task will not take a slot here: its permit, if granted, goes back."""
        asking.dropped = True
        if asking.held is not None:
            self._let_go(asking, asking.held[1])

    def _let_go(self, asking: _Asking, answer: Answer) -> None:  # (of an ask made ahead)
        asking.held = None
        asking.settled = True
        self.runs.answered(asking.run, asking.req)
        if isinstance(answer, Permit) and not self.runs.handed_here(asking.run):
            release_quietly(asking.sem, answer)  # (never the permit of a run going on here)

    def _send(self, asking: _Asking, lease: float, back_in: float, then: _Then) -> None:
        """Send one ask for ``asking``; ``then`` gets its answer (unless that is an error)."""
        asking.lease, asking.back_in, asking.asked = lease, back_in, time.monotonic()
        self.runs.asking(asking.run, asking.req)
        done = partial(self._on_answer, asking, then)
        self._asks_for().ask(asking.sem, asking.run, waiter_lease=lease, back_in=back_in, done=done)

    def _asks_for(self) -> Asks:
        if self._asks is None:
            try:
                client = get_client(self.app)
            except Exception:  # (get_config worked: a client error is the child's to report)
                return WaitingAsks()
            hub = getattr(self.controller, "hub", None)
            self._asks = asks_for(hub, client)
            if hub is not None and self.lot.slots is not None:
                writes = partial(unwritten_tasks, self.controller)
                self.ahead.install(hub, self.lot.slots, self.process_task, writes)
        return self._asks

    def _on_answer(self, asking: _Asking, then: _Then, answer: Answer) -> None:
        """An answer came for ``asking``: act on it, unless the worker moved on meanwhile.

        Asked ahead of its slot, a task is parked at once if it waits (it never takes a
        slot); any other answer is kept until it takes one (a free slot at once if granted).
        """
        if not asking.slotted:
            if asking.dropped:
                self._let_go(asking, answer)
                return
            if not isinstance(answer, Waiting) or self._moved_on(asking):
                self._keep_for_slot(asking, then, answer)
                return
        self.runs.answered(asking.run, asking.req)
        try:
            if self._gone(asking, answer):
                return
            if isinstance(answer, BackendError):
                if asking.asked >= self.gate.paused_at:  # (not one more of the asks it failed)
                    self.gate.pause(answer)
                self._settle(asking, None)
                return
            self.gate.answered()
            then(asking, answer)
        except Exception:  # never lose a task to a bug here: the child decides
            logger.exception("celery_redsem: admission failed for %s", asking.req)
            if asking.settled:
                return
            if asking.slotted:
                self._settle(asking, None)
            else:  # (with its slot)
                self._keep_for_slot(asking, self._to_child, answer)

    def _gone(self, asking: _Asking, answer: Answer) -> bool:
        """Whether the worker moved on while ``asking``'s ask was in flight: it is shutting
        down (the task goes to its child, which asks, if it runs), or the broker connection
        the task came on was lost (its message will be delivered again: dropped here, its slot
        with it, as the consumer reset its slots)."""
        if not self._moved_on(asking):
            return False
        stopping = self.lot.stopping()
        if isinstance(answer, Permit):
            release_quietly(asking.sem, answer)
        asking.settled = True
        if stopping:
            self._dispatch(asking.req)
        return True

    def _moved_on(self, asking: _Asking) -> bool:
        """Whether the worker stops, or lost the broker connection ``asking`` was asked on."""
        connection = getattr(self.controller.consumer, "connection", None)
        return self.lot.stopping() or connection is not asking.connection

    def _hold_for_slot(self, asking: _Asking, answer: Waiting) -> bool:
        """Whether ``asking``'s task must take a slot before ``answer`` is acted on (it was
        asked for ahead of its slot, and goes to the pool after all): kept until then."""
        if asking.slotted:
            return False
        self.runs.asking(asking.run, asking.req)  # (answered when it takes its slot)
        self._keep_for_slot(asking, self._answered, answer)
        return True

    def _keep_for_slot(self, asking: _Asking, then: _Then, answer: Answer) -> None:
        """Keep ``answer`` for ``asking``'s task, asked for ahead, until it takes its slot
        (``then`` acts on it there); a free slot is taken at once."""
        asking.held = (then, answer, time.monotonic())
        self.ahead.claim_slot(asking.req)

    def _to_child(self, asking: _Asking, _answer: Permit | Waiting) -> None:
        """Dispatch ``asking``'s request without a permit: its child decides."""
        self._settle(asking, None)

    def _answered(self, asking: _Asking, result: Permit | Waiting) -> None:
        """The first answer: dispatch with the permit, or park (telling Redis when the task
        will ask again), or leave the task to its child."""
        if isinstance(result, Permit):
            self._settle(asking, result)
            return
        req, earlier = asking.req, asking.earlier
        now_ms = server_ms(result, asking.lease)
        if earlier is not None and earlier.first_ms >= 0:
            first_ms = earlier.first_ms
        else:
            first_ms = read_wait_of(req.request_dict).first_ms or now_ms
            first_ms = min(first_ms, now_ms)  # never in the future
        tries = earlier.tries + 1 if earlier is not None else 0
        park = park_time(
            position=result.position,
            limit=asking.sem.limit,
            hold=asking.hold,
            tries=tries,
            longest=asking.longest,
        )
        waited = (now_ms - first_ms) / 1000
        max_wait = asking.guard.max_wait_for(asking.config)
        if max_wait is not None:
            if waited >= max_wait:  # the child fails it with AcquireTimeout
                if self._hold_for_slot(asking, result):
                    return
                stamp_wait_began(req.request_dict, first_ms)
                self._settle(asking, None)
                return
            park = min(park, max(MIN_PARK, max_wait - waited))
        delivered = received_at(req, earlier, asking.asked)
        held_for = asking.asked - delivered  # the broker's visibility clock runs from delivery
        if held_for >= asking.longest or len(self.parked) >= MAX_PARKED_TASKS:
            # The child decides, most often a retry: a new message (with a countdown, held as
            # an ETA task is), this one acknowledged.
            if self._hold_for_slot(asking, result):
                return
            stamp_wait_began(req.request_dict, first_ms)
            self._settle(asking, None)
            return
        if self._stand_by(asking, result):
            stamp_wait_began(req.request_dict, first_ms)
            return
        park = min(park, max(MIN_PARK, asking.longest - held_for))
        parked = Parked(req, asking.sem.name, result.position, first_ms, tries, None, delivered)
        if asking.back_in and park <= asking.back_in:
            # Back before its place expects it: its place is kept (it ends a margin after
            # back_in), and asking early only competes for a free permit.
            self._park(asking, parked, park)
            return
        lease = park + asking.config.waiter_margin
        self._send(asking, lease, park, partial(self._answered_again, parked=parked, park=park))

    def _answered_again(
        self, asking: _Asking, result: Permit | Waiting, *, parked: Parked, park: float
    ) -> None:
        """The answer to the ask that told Redis when the task will be back: park it."""
        if isinstance(result, Permit):
            self._settle(asking, result)
            return
        parked.position = result.position
        self._park(asking, parked, park)

    def _settle(self, asking: _Asking, permit: Permit | None) -> None:
        """Dispatch ``asking``'s request to the pool, with ``permit`` if it got one."""
        asking.settled = True
        req = asking.req
        if permit is not None:
            earlier = asking.earlier
            record_admission_grant(req, permit, earlier.first_ms if earlier else -1)
            hand_over(req.request_dict, permit, asking.asked)
            self.runs.handed(req, permit.name)
        self._dispatch(req)
        if permit is not None:
            self._recruit(permit.name)

    def _stand_by(self, asking: _Asking, result: Waiting) -> bool:
        """Dispatch ``asking``'s request without a permit, as the standby of its semaphore, if
        it should be one (:mod:`~celery_redsem.integration.admission.standby`)."""
        name, semaphore = asking.sem.name, self.lot.slots
        if not self.standbys.wanted(
            name,
            position=result.position,
            limit=asking.sem.limit,
            hold=asking.hold,
            head_wait=asking.config.head_wait,
            # (besides its own: a task asked for ahead has not taken it yet)
            free_slots=semaphore.value - int(not asking.slotted) if semaphore is not None else 0,
        ):
            return False
        if self._hold_for_slot(asking, result):
            return True
        req = asking.req
        self.standbys.add(name, req)
        asking.settled = True
        mark_standby(req.request_dict)
        hub = getattr(self.controller, "hub", None)
        if hub is not None and not req.task.acks_late and hasattr(req, "redsem_hold_ack"):
            req.redsem_hold_ack()  # acknowledged when its child gets the permit
            self.notices.expect(hub, req)
        self.runs.handed(req, name, learn=False, then=partial(self._standby_ended, req))
        self._dispatch(req)
        return True

    def _standby_ended(self, req: Any) -> None:
        """A standby's run ended: acknowledge it if its child never told of a grant."""
        self.notices.done(req)
        if hasattr(req, "redsem_ack"):
            req.redsem_ack()

    def _recruit(self, name: str) -> None:
        """A permit of ``name`` was just handed over here: if no standby waits for the next
        one, the first task parked on it asks now (and may become the standby)."""
        semaphore = self.lot.slots
        if name in self.standbys or semaphore is None or semaphore.value < 2:
            return
        first = self.parked.first_in_line(name)
        if first is not None:
            self.lot.wake(first)

    def _park(self, asking: _Asking, parked: Parked, seconds: float) -> None:
        asking.settled = True
        if not asking.slotted:  # asked ahead: out of the slot queue, parked without a slot
            self.ahead.unqueue(asking.req)
            record_unpark(self.parked.remove(asking.req))
        self.lot.park(parked, seconds, slot_taken=asking.slotted)

    # -- finished tasks wake parked ones -------------------------------------------------

    def _wake_one(self, name: str, ended_id: str) -> None:
        """A run of task ``ended_id`` gave back a permit of ``name`` here: the first task
        parked on it asks again, and so do copies of ``ended_id`` that waited for that run."""
        self.standbys.released(name)
        first = self.parked.first_in_line(name)
        for parked in [*self.parked.copies_of(ended_id, name), *([first] if first else [])]:
            self.lot.wake(parked)


def install_admission(controller: Any, app: Celery) -> Admission | None:
    """Install :class:`Admission` on a worker (at ``worker_init``); None if already there."""
    if isinstance(getattr(controller, "_redsem_admission", None), Admission):
        return None
    admission = Admission(controller, app)
    controller._redsem_admission = admission
    controller._process_task = admission.process_task
    return admission
