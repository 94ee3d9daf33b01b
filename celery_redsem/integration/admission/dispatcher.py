"""Admission at dispatch: a worker gives a pool slot only to a task that has its permit.

For a task with one guard, :class:`Admission` asks for the permit (joining the line under the
run's permit id) without the event loop waiting for the reply (:mod:`.asks`), also for the
first task queued for a slot before the slot frees (:mod:`.ask_ahead`). Once the task holds its
slot and the answer is there (:meth:`Admission.advance`, over :mod:`.stages`), it goes to its
child with the permit (:mod:`~celery_redsem.integration.wire`), or waits in its child as the
semaphore's *standby* (:mod:`.standby`), or is *parked* here, unacknowledged, its slot given to
the next task (:mod:`.parking`). A parked task asks again when its turn is expected, or at once
when a run of its semaphore ends here (:mod:`.live_runs`), or, on a grouped semaphore, when a
release offers it the permit (:mod:`~celery_redsem.integration.worker.fair_wakes`). A task
whose one guard is a rate limit is parked until the start its limiter booked for it.

Past the parking's bounds (:mod:`~celery_redsem.integration.policy`) or ``redsem_max_wait``, a
task goes to its child, which retries it through the broker or fails it. Anything unusual hands
the task to its child unchanged (:mod:`~celery_redsem.integration.guards.contention`): several
guards, a key function that fails or is slow (:mod:`.gate`), ``min_replicas``, a stopping
worker, any error on admission's path, Redis errors (admission pauses). Celery's and kombu's
private API is reached through :mod:`~celery_redsem.integration.seam`.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, cast

from celery import Celery

from celery_redsem.core.errors import BackendError
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit, Waiting
from celery_redsem.integration import seam
from celery_redsem.integration.admission.ask_ahead import HELD_WAITING_FRESH, AskAhead
from celery_redsem.integration.admission.asks import Asks, WaitingAsks, asks_for
from celery_redsem.integration.admission.gate import Gate
from celery_redsem.integration.admission.live_runs import LiveRuns
from celery_redsem.integration.admission.parking import Parked, ParkingLot, RateGuard, received_at
from celery_redsem.integration.admission.stages import Answer, Candidate, PermitGuard, Stage, Then
from celery_redsem.integration.admission.standby import GrantNotices, Standbys
from celery_redsem.integration.admission.wiring import wire
from celery_redsem.integration.guards.contention import paused_recheck
from celery_redsem.integration.guards.naming import call_arguments
from celery_redsem.integration.line import release_quietly, server_ms
from celery_redsem.integration.policy import (
    MAX_PARKED_TASKS,
    MIN_PARK,
    first_ask,
    hold_times,
    longest_park,
    park_time,
)
from celery_redsem.integration.settings import get_client, get_config
from celery_redsem.integration.wire import (
    clear_dispatch_fields,
    hand_over,
    mark_standby,
    read_wait_of,
    stamp_wait_began,
)
from celery_redsem.integration.worker.fair_wakes import Offers
from celery_redsem.metrics import metrics_on, record_grant, record_unpark

__all__ = ["Admission"]

logger = logging.getLogger(__name__)


class Admission:
    """Asks for the permit of a guarded task when a pool slot is free; parks it if none is."""

    def __init__(self, controller: Any, app: Celery) -> None:
        self.controller = controller
        self.app = app
        hub = getattr(controller, "hub", None)
        self.wiring = wire(controller, self.process_task)
        self.slots = self.wiring.slots
        self._dispatch = self.wiring.dispatch
        self.ahead: AskAhead[Candidate] = AskAhead(self._ask_ahead, self._drop_ahead)
        self.lot = (
            None
            if self.slots is None
            else ParkingLot(controller, self.slots, self.ahead.ask_now, hub, self.wiring.timer)
        )
        self.runs = LiveRuns(self._wake_one, self.wiring.in_loop)  # asked for or handed over here
        self.standbys = Standbys()
        green_loop = self.wiring.green_loop
        self.notices = (
            GrantNotices(green_loop.call_soon if green_loop is not None else None)
            if hub is not None or green_loop is not None
            else None  # (solo: no admission)
        )
        self._asks: Asks | None = None
        self.offers = Offers()  # a grouped semaphore's release wakes the next in fair order
        self.gate = Gate()  # which tasks admission decides for; its pause after an error

    # -- the hook -------------------------------------------------------------------------

    def process_task(self, req: Any) -> Any:
        """Stands in for the worker's ``_process_task``: called with a slot taken for ``req``."""
        lot = self.lot
        if lot is None:  # a pool without slots: its children decide
            return self._dispatch(req)
        asked_ahead = self.ahead.take(req)
        earlier = lot.tasks.remove(req)
        record_unpark(earlier)
        clear_dispatch_fields(req.request_dict)
        if asked_ahead is not None and self._took_slot(asked_ahead):
            return None  # its answer is acted on now, or when it comes
        if lot.stopping():
            return self._at_stop(req)
        guard = self.gate.guard_of(req)
        if guard is None:
            return self._dispatch(req)
        try:
            if guard.kind == "rate":
                lot.admit_rate(self.app, req, cast(RateGuard, guard), earlier)
                self.gate.answered()
            elif self._ask(req, cast(PermitGuard, guard), earlier):
                return None  # answered later (or already): dispatched or parked then
        except BackendError as exc:
            self.gate.pause(exc)
        except Exception:  # never lose a task to a bug here: the child decides
            logger.exception("celery_redsem: admission failed for %s[%s]", req.name, req.id)
        if req in lot.tasks:
            return None
        return self._dispatch(req)

    def _at_stop(self, req: Any) -> Any:
        """The worker stops: on prefork the task goes to its child, which asks, if it runs;
        on the other pools nothing more starts (its acknowledgement could not go out, and it
        would run again elsewhere): its message goes back to the broker as the worker stops."""
        assert self.slots is not None
        if not self.slots.gated_here:
            return self._dispatch(req)
        self.slots.give_back()
        return None

    # -- asking ---------------------------------------------------------------------------

    def _ask(
        self, req: Any, guard: PermitGuard, earlier: Parked | None, *, ahead: bool = False
    ) -> bool:
        """Ask for ``req``'s permit; False if its child should decide instead (dispatch it).

        When the answer comes, :meth:`advance` dispatches ``req`` with the permit, parks it
        (its slot given back), or dispatches it without one for its child to decide; asked
        ``ahead`` of its slot, only once it takes the slot (:meth:`_took_slot`).
        """
        assert self.lot is not None
        task = req.task
        config = get_config(self.app)
        args, kwargs = call_arguments(task, req.args), req.kwargs or {}
        try:
            named = self.gate.slow_keys.call(
                task.name, lambda: guard.naming_for(task.name, args, kwargs)
            )
        except Exception:  # the child reports a bad key (or limit) function, visibly
            return False
        if named is None:  # too slow for here: the child asks
            return False
        name, limit, share = named
        sem = guard.semaphore(self.app, name, config, limit, share)
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
        candidate = Candidate(req, guard, earlier, sem, run, config, hold, longest, connection)
        behind = None if earlier is not None else self.lot.tasks.deepest_position(name)
        lease, back_in = first_ask(
            config.present_waiter_lease,
            config.waiter_margin,
            limit=sem.limit,
            behind=behind,
            hold=hold,
            longest=longest,
        )
        if ahead:
            candidate.stage = Stage.AHEAD
            if not back_in:  # away until its slot: its place holds no free permit meanwhile
                back_in = HELD_WAITING_FRESH
                lease = back_in + config.waiter_margin
            self.ahead.sent(req, candidate)
        self._send(candidate, lease, back_in)
        return True

    def _ask_ahead(self, req: Any) -> None:
        """Ask for the permit of ``req``, queued for a slot (:mod:`.ask_ahead`), if it should
        be. If the ask fails, none is kept: ``req`` is asked for when it takes its slot, and
        goes to its child if that fails too."""
        try:
            guard = None if self.lot is None or self.lot.stopping() else self.gate.guard_of(req)
            if guard is not None and guard.kind == "permit":
                earlier = self.lot.tasks.get(req) if self.lot is not None else None
                self._ask(req, cast(PermitGuard, guard), earlier, ahead=True)
        except Exception:
            self.ahead.unsent(req)
            logger.warning("celery_redsem: no ask ahead for %s", req, exc_info=True)

    def _took_slot(self, candidate: Candidate) -> bool:
        """``candidate``, asked for ahead, took its slot: act on its answer now if it came
        (False: too old to act on, or given up: ask again), else when it comes."""
        if candidate.stage is Stage.AHEAD:
            candidate.stage = Stage.SLOTTED
            return True
        if candidate.stage is not Stage.KEPT:
            return False
        answer, candidate.kept = candidate.kept, None
        candidate.stage = Stage.SLOTTED
        fresh = HELD_WAITING_FRESH if isinstance(answer, Waiting) else candidate.sem.lease / 3
        if time.monotonic() - candidate.kept_at > fresh:
            self.runs.answered(candidate.run, candidate.req)  # (asked again: a grant is renewed)
            candidate.stage = Stage.DONE
            return False
        assert answer is not None
        self.advance(candidate, answer)
        return True

    def _drop_ahead(self, candidate: Candidate) -> None:
        """``candidate`` will not take a slot here: its permit, if granted, goes back."""
        kept = candidate.stage is Stage.KEPT
        candidate.stage = Stage.DROPPED
        if kept:
            self._let_go(candidate, candidate.kept)

    def _let_go(self, candidate: Candidate, answer: Answer | None) -> None:
        """Give up ``candidate``, asked ahead (and its grant, unless its run goes on here)."""
        candidate.kept, candidate.stage = None, Stage.DONE
        self.runs.answered(candidate.run, candidate.req)
        if isinstance(answer, Permit) and not self.runs.handed_here(candidate.run):
            release_quietly(candidate.sem, answer)

    def _send(self, candidate: Candidate, lease: float, back_in: float) -> None:
        """Send one ask for ``candidate``; :meth:`advance` gets its answer."""
        candidate.lease, candidate.back_in, candidate.asked = lease, back_in, time.monotonic()
        self.runs.asking(candidate.run, candidate.req)
        sem, done = candidate.sem, partial(self.advance, candidate)
        try:
            ask = self._asks_for().ask
            notify = self.offers.notify_for(sem)  # (grouped: its turn is offered to this worker)
            ask(sem, candidate.run, waiter_lease=lease, back_in=back_in, done=done, notify=notify)
        except BaseException:
            self.runs.answered(candidate.run, candidate.req)
            raise

    def _asks_for(self) -> Asks:
        if self._asks is None:
            try:
                client = get_client(self.app)
            except Exception:  # (get_config worked: a client error is the child's to report)
                return WaitingAsks()
            hub = getattr(self.controller, "hub", None)
            self._asks = asks_for(hub, client)
            green, prefix = self.wiring.green_loop, get_config(self.app).key_prefix
            self.offers.start(client, prefix, self.lot, hub=hub, green=green)
            if hub is not None and isinstance(self.slots, seam.SlotQueue):
                writes = partial(seam.unwritten_tasks, self.controller)
                self.ahead.install(hub, self.slots, writes)
        return self._asks

    # -- the answer --------------------------------------------------------------------------

    def advance(self, candidate: Candidate, answer: Answer) -> None:
        """An answer came for ``candidate``'s ask: move it on, unless the worker moved on.

        Asked ahead of its slot, a task is parked at once if it waits (it never takes a slot);
        any other answer is kept until it takes one (a free slot at once if granted). Whatever
        fails here sends the task to its child, once it holds its slot.
        """
        stage = candidate.stage
        if stage is Stage.DONE:
            return
        if stage is Stage.DROPPED:
            self._let_go(candidate, answer)
            return
        if stage is Stage.AHEAD and (not isinstance(answer, Waiting) or self._moved_on(candidate)):
            self._keep_for_slot(candidate, answer)
            return
        self.runs.answered(candidate.run, candidate.req)
        try:
            self._act(candidate, answer)
        except Exception:  # never lose a task to a bug here: the child decides
            logger.exception("celery_redsem: admission failed for %s", candidate.req)
            if candidate.stage is Stage.SLOTTED:
                self._settle(candidate, None)
            elif candidate.stage is Stage.AHEAD:
                candidate.then = Then.TO_CHILD
                self._keep_for_slot(candidate, answer)

    def _act(self, candidate: Candidate, answer: Answer) -> None:
        if self._gone(candidate, answer):
            return
        if isinstance(answer, BackendError):
            if candidate.asked >= self.gate.paused_at:  # (not one more of the asks it failed)
                self.gate.pause(answer)
            self._settle(candidate, None)
            return
        self.gate.answered()
        if candidate.then is Then.TO_CHILD:
            self._settle(candidate, None)
        elif isinstance(answer, Permit):
            self._settle(candidate, answer)
        elif candidate.then is Then.PARK:
            assert candidate.parked is not None
            candidate.parked.position = answer.position
            self._park(candidate, candidate.parked, candidate.park_for)
        else:
            self._first_wait(candidate, answer)

    def _gone(self, candidate: Candidate, answer: Answer) -> bool:
        """Whether the worker moved on while ``candidate``'s ask was in flight: it is shutting
        down (see :meth:`_at_stop`), or the broker connection the task came on was lost (its
        message will be delivered again: dropped here, its slot with it, as the consumer reset
        its slots)."""
        if not self._moved_on(candidate):
            return False
        assert self.lot is not None
        stopping = self.lot.stopping()
        if isinstance(answer, Permit):
            release_quietly(candidate.sem, answer)
        slotted = candidate.slotted
        candidate.stage = Stage.DONE
        if stopping and slotted:
            self._at_stop(candidate.req)
        return True

    def _moved_on(self, candidate: Candidate) -> bool:
        """Whether the worker stops, or lost the broker connection ``candidate`` was asked on."""
        assert self.lot is not None
        connection = getattr(self.controller.consumer, "connection", None)
        return self.lot.stopping() or connection is not candidate.connection

    def _hold_for_slot(self, candidate: Candidate, answer: Waiting) -> bool:
        """Whether ``candidate`` must take a slot before ``answer`` is acted on (it was asked
        for ahead of its slot, and goes to the pool after all): kept until then."""
        if candidate.slotted:
            return False
        self.runs.asking(candidate.run, candidate.req)  # (answered when it takes its slot)
        self._keep_for_slot(candidate, answer)
        return True

    def _keep_for_slot(self, candidate: Candidate, answer: Answer) -> None:
        """Keep ``answer`` for ``candidate``, asked for ahead, until it takes its slot (then
        :meth:`advance` acts on it); a free slot is taken at once."""
        candidate.stage = Stage.KEPT
        candidate.kept, candidate.kept_at = answer, time.monotonic()
        self.ahead.claim_slot(candidate.req)

    def _first_wait(self, candidate: Candidate, result: Waiting) -> None:
        """The first answer says the task waits: park it (telling Redis when it will ask
        again), make it the standby, or leave it to its child."""
        assert self.lot is not None
        req, earlier = candidate.req, candidate.earlier
        now_ms = server_ms(result, candidate.lease)
        if earlier is not None and earlier.first_ms >= 0:
            first_ms = earlier.first_ms
        else:
            first_ms = read_wait_of(req.request_dict).first_ms or now_ms
            first_ms = min(first_ms, now_ms)  # never in the future
        tries = earlier.tries + 1 if earlier is not None else 0
        park = park_time(
            position=result.position,
            limit=candidate.sem.limit,
            hold=candidate.hold,
            tries=tries,
            longest=candidate.longest,
        )
        if result.paused:  # parked to the pause's end (asking again at least this often)
            park, first_ms = min(result.paused, paused_recheck(candidate.config)), now_ms
        waited = (now_ms - first_ms) / 1000
        max_wait = candidate.guard.max_wait_for(candidate.config.max_wait)
        if max_wait is not None:
            if waited >= max_wait:  # the child fails it with AcquireTimeout
                if not self._hold_for_slot(candidate, result):
                    stamp_wait_began(req.request_dict, first_ms)
                    self._settle(candidate, None)
                return
            park = min(park, max(MIN_PARK, max_wait - waited))
        delivered = received_at(req, earlier, candidate.asked)
        held_for = candidate.asked - delivered  # the broker's visibility clock runs from delivery
        if held_for >= candidate.longest or len(self.lot.tasks) >= MAX_PARKED_TASKS:
            # The child decides, most often a retry: a new message (with a countdown, held as
            # an ETA task is), this one acknowledged.
            if not self._hold_for_slot(candidate, result):
                stamp_wait_began(req.request_dict, first_ms)
                self._settle(candidate, None)
            return
        if not result.paused and self._stand_by(candidate, result):
            stamp_wait_began(req.request_dict, first_ms)
            return
        park = min(park, max(MIN_PARK, candidate.longest - held_for))
        parked = Parked(req, candidate.sem.name, result.position, first_ms, tries, None, delivered)
        if candidate.back_in and park <= candidate.back_in:
            # Back before its place expects it: its place is kept (it ends a margin after
            # back_in), and asking early only competes for a free permit.
            self._park(candidate, parked, park)
            return
        candidate.then, candidate.parked, candidate.park_for = Then.PARK, parked, park
        self._send(candidate, park + candidate.config.waiter_margin, park)

    def _settle(self, candidate: Candidate, permit: Permit | None) -> None:
        """Dispatch ``candidate``'s request to the pool, with ``permit`` if it got one."""
        candidate.stage = Stage.DONE
        req = candidate.req
        if permit is not None:
            if metrics_on():
                earlier = candidate.earlier
                first_ms = earlier.first_ms if earlier is not None else -1
                if first_ms <= 0:
                    first_ms = read_wait_of(req.request_dict).first_ms
                waited = (server_ms(permit, 0) - first_ms) / 1000 if first_ms > 0 else 0.0
                record_grant(str(req.name), waited)
            hand_over(req.request_dict, permit, candidate.asked)
            self.runs.handed(req, permit.name)
        self._dispatch(req)
        if permit is not None:
            self._recruit(permit.name)

    def _stand_by(self, candidate: Candidate, result: Waiting) -> bool:
        """Dispatch ``candidate``'s request without a permit, as the standby of its semaphore,
        if it should be one (:mod:`.standby`)."""
        assert self.slots is not None
        name = candidate.sem.name
        if not self.standbys.wanted(
            name,
            position=result.position,
            limit=candidate.sem.limit,
            hold=candidate.hold,
            head_wait=candidate.config.head_wait,
            # (besides its own: a task asked for ahead has not taken it yet)
            free_slots=self.slots.free - int(not candidate.slotted),
        ):
            return False
        if self._hold_for_slot(candidate, result):
            return True
        req = candidate.req
        self.standbys.add(name, req)
        candidate.stage = Stage.DONE
        mark_standby(req.request_dict)
        hub = getattr(self.controller, "hub", None)
        notices = self.notices
        if notices is not None and not req.task.acks_late and hasattr(req, "redsem_hold_ack"):
            req.redsem_hold_ack()  # acknowledged when its child gets the permit
            notices.expect(hub, req)
        self.runs.handed(req, name, learn=False, then=partial(self._standby_ended, req))
        self._dispatch(req)
        return True

    def _standby_ended(self, req: Any) -> None:
        """A standby's run ended: acknowledge it if its child never told of a grant."""
        if self.notices is not None:
            self.notices.done(req)
        if hasattr(req, "redsem_ack"):
            req.redsem_ack()

    def _recruit(self, name: str) -> None:
        """A permit of ``name`` was just handed over here: if no standby waits for the next
        one, the first task parked on it asks now (and may become the standby)."""
        if name in self.standbys or self.slots is None or self.slots.free < 2:
            return
        if self.offers.wake_by_offers(name):  # (the next in fair order is offered the permit)
            return
        assert self.lot is not None
        first = self.lot.tasks.first_in_line(name)
        if first is not None:
            self.lot.wake(first)

    def _park(self, candidate: Candidate, parked: Parked, seconds: float) -> None:
        assert self.lot is not None
        slotted = candidate.slotted
        candidate.stage = Stage.DONE
        if not slotted:  # asked ahead: out of the slot queue, parked without a slot
            self.ahead.unqueue(candidate.req)
            record_unpark(self.lot.tasks.remove(candidate.req))
        self.lot.park(parked, seconds, slot_taken=slotted)
        self.offers.parked(candidate.run, parked)

    # -- finished tasks wake parked ones -------------------------------------------------

    def _wake_one(self, name: str, ended_id: str) -> None:
        """A run of task ``ended_id`` gave back a permit of ``name`` here: the first task
        parked on it asks again, and so do copies of ``ended_id`` that waited for that run."""
        assert self.lot is not None
        self.standbys.released(name)
        tasks = self.lot.tasks
        first = None if self.offers.wake_by_offers(name) else tasks.first_in_line(name)
        for parked in [*tasks.copies_of(ended_id, name), *([first] if first else [])]:
            self.lot.wake(parked)
