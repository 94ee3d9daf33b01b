"""Asking ahead of the slot, the parked line's indexes and the prefetch window of parked tasks.

:class:`AskAhead` is driven by a real kombu event loop and the slot semaphore Celery's prefork
pool uses (a reset of that loop is what a lost broker connection does); a real worker shows a
queued task holding its permit before its slot frees, and every task run once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.concurrency.prefork import TaskPool
from kombu import Connection
from kombu.asynchronous import Hub
from kombu.asynchronous.semaphore import LaxBoundedSemaphore
from kombu.common import QoS

from celery_redsem.integration.admission.ask_ahead import ASK_AHEAD, HELD_FOR_AT_MOST, AskAhead
from celery_redsem.integration.admission.parking import Parked, ParkedTasks, ParkingLot
from celery_redsem.integration.admission.prefetch import (
    WINDOW_STEP,
    widen_for_parked,
    window_step,
)
from celery_redsem.integration.seam import SlotQueue, unwritten_tasks
from tests.integration.conftest import WorkerProcess, holder
from tests.integration.test_asks import run_until
from tests.servers import wait_until

# -- the parked line's indexes ------------------------------------------------------------------


class _Req:
    """A request as ParkedTasks sees one: a task id (its permit id) and nothing else."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id
        self.request_dict: dict[str, Any] = {}


def _parked(name: str, position: int, task_id: str = "", first_ms: int = 1) -> Parked:
    req = _Req(task_id or f"{name}-{position}-{time.monotonic_ns()}")
    return Parked(req, name, position, first_ms, 0, None, 0.0, timer=object())


def test_the_first_in_line_and_the_deepest_follow_the_parked_tasks() -> None:
    tasks = ParkedTasks()
    line = [_parked("a", p) for p in (5, 2, 9, 7)]
    for parked in line:
        tasks.add(parked)
    tasks.add(_parked("b", 1))
    assert tasks.first_in_line("a") is line[1]
    assert tasks.deepest_position("a") == 9
    tasks.remove(line[1].req)  # the first leaves: the next takes its place
    assert tasks.first_in_line("a") is line[0]
    line[0].timer = None  # resumed (asking again): no longer first in line
    assert tasks.first_in_line("a") is line[3]
    tasks.remove(line[2].req)  # the deepest leaves
    assert tasks.deepest_position("a") == 7
    again = _parked("a", 3)
    tasks.add(again)
    assert tasks.first_in_line("a") is again
    for parked in [line[0], line[3], again]:
        tasks.remove(parked.req)
    assert tasks.first_in_line("a") is None
    assert tasks.deepest_position("a") is None
    assert tasks.first_in_line("b") is not None


def test_copies_of_a_running_run_are_found_by_its_permit_id_and_are_not_in_line() -> None:
    tasks = ParkedTasks()
    copy = _parked("a", 0, task_id="run-1", first_ms=-1)
    other = _parked("a", 0, task_id="run-2", first_ms=-1)
    waiting = _parked("a", 4, task_id="run-3")
    for parked in (copy, other, waiting):
        tasks.add(parked)
    assert tasks.copies_of("run-1", "a") == [copy]
    assert tasks.copies_of("run-1", "b") == []
    assert tasks.first_in_line("a") is waiting  # copies wait for their run, not in line
    tasks.remove(copy.req)
    assert tasks.copies_of("run-1", "a") == []
    assert tasks.copies_of("run-2", "a") == [other]


# -- AskAhead on a real event loop and slot semaphore -------------------------------------------


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop_hub = Hub()
    yield loop_hub
    loop_hub.close()


class _Recorder:
    """What AskAhead asked for and gave up; ``asks`` says which requests get an ask (made as
    admission makes one: told to AskAhead just before it is sent, then ``then`` runs, as an
    answer called back at once would)."""

    def __init__(self, asks: bool = True) -> None:
        self.asks = asks
        self.asked: list[object] = []
        self.dropped: list[str] = []
        self.ahead: AskAhead[str] | None = None
        self.then: Any = None
        self.taken: list[object] = []  # what each task took with its slot

    def process_task(self, req: object) -> None:
        """The slot queue's callback: the task takes its slot, and what was asked ahead."""
        assert self.ahead is not None
        self.taken.append(self.ahead.take(req))

    def make(self, held_for_at_most: float = 60.0) -> AskAhead[str]:
        self.ahead = AskAhead(self.ask, self.drop, held_for_at_most)
        self.busy()
        return self.ahead

    def busy(self) -> None:
        """Slots handed out moments ago, as in a busy worker (AskAhead asks only then)."""
        assert self.ahead is not None
        for _ in range(30):  # (the pace is an average of the gaps between hand-outs)
            self.ahead.take(object())

    def ask(self, req: object) -> None:
        self.asked.append(req)
        if self.asks and self.ahead is not None:
            self.ahead.sent(req, f"ask-for-{id(req)}")
            if self.then is not None:
                self.then()

    def drop(self, asked: str) -> None:
        self.dropped.append(asked)


def _installed(hub: Hub, slots: int = 1) -> tuple[LaxBoundedSemaphore, _Recorder, AskAhead[str]]:
    """A slot semaphore of ``slots``, and an AskAhead on it (busy) asking through a recorder."""
    semaphore = LaxBoundedSemaphore(slots)
    recorder = _Recorder()
    ahead = recorder.make()
    ahead.install(hub, SlotQueue(semaphore, recorder.process_task))
    return semaphore, recorder, ahead


def turn(hub: Hub, times: int) -> None:
    """Turn the event loop ``times`` times."""
    loop = hub.create_loop()
    for _ in range(times):
        next(loop)


def _ignore(req: object) -> None:
    """A slot queue's callback (what process_task would be)."""


def _queued(slots: LaxBoundedSemaphore, process_task: Any, count: int) -> list[object]:
    """``count`` requests queued for a slot of ``slots`` (all of them taken)."""
    while slots.value > 0:
        slots.acquire(lambda: None)
    reqs = [object() for _ in range(count)]
    for req in reqs:
        slots.acquire(process_task, req)
    return reqs


def test_the_first_tasks_queued_for_a_slot_are_asked_for_once_and_taken_with_it(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(2)
    recorder = _Recorder()
    ahead = recorder.make()
    reqs = _queued(slots, recorder.process_task, 5)
    slots.acquire(lambda req: None, object())  # not a task admission hands out: never asked
    ahead.install(hub, SlotQueue(slots, recorder.process_task))
    ahead.install(hub, SlotQueue(slots, recorder.process_task))  # once per event loop
    run_until(hub, lambda: len(recorder.asked) >= ASK_AHEAD, 5)
    turn(hub, 5)  # more turns of the loop ask nothing more
    assert recorder.asked == reqs[:ASK_AHEAD]
    recorder.busy()
    slots.release()  # the first takes its slot, with its ask; the next in the queue is asked
    assert recorder.taken == [f"ask-for-{id(reqs[0])}"]
    run_until(hub, lambda: len(recorder.asked) == ASK_AHEAD + 1, 5)
    assert recorder.asked[-1] is reqs[ASK_AHEAD]
    assert recorder.dropped == []


def test_a_task_that_takes_its_slot_while_it_is_being_asked_for_takes_the_ask(hub: Hub) -> None:
    # An answer called back at once (a broken connection fails every ask in flight) can free
    # a slot, and the queue hands it to the task being asked for before the ask returns.
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead = recorder.make()
    reqs = _queued(slots, recorder.process_task, 3)

    def free_the_slot_once() -> None:
        recorder.then = None
        slots.release()

    recorder.then = free_the_slot_once  # the first ask frees the slot as it is sent
    ahead.install(hub, SlotQueue(slots, recorder.process_task))
    run_until(hub, lambda: len(recorder.asked) >= 1, 5)
    assert recorder.taken == [f"ask-for-{id(reqs[0])}"]  # taken with its slot, not asked again
    run_until(hub, lambda: len(recorder.asked) == 1 + ASK_AHEAD, 5)  # the queue as it is now
    assert recorder.asked == reqs[: 1 + ASK_AHEAD]
    ahead.sweep()
    assert recorder.dropped == []  # nothing left behind for the task that took its slot


def test_asks_for_tasks_gone_from_the_slot_queue_are_given_up(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead = recorder.make()
    reqs = _queued(slots, recorder.process_task, 3)
    ahead.install(hub, SlotQueue(slots, recorder.process_task))
    run_until(hub, lambda: len(recorder.asked) == ASK_AHEAD, 5)
    ahead.sweep()
    assert recorder.dropped == []  # still queued: kept
    slots.clear()  # as the consumer does when its broker connection is lost
    ahead.sweep()
    assert sorted(recorder.dropped) == sorted(f"ask-for-{id(r)}" for r in reqs[:ASK_AHEAD])


def test_every_ask_is_given_up_when_the_event_loop_resets(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead = recorder.make()
    _queued(slots, _ignore, 3)
    ahead.install(hub, SlotQueue(slots, _ignore))
    run_until(hub, lambda: len(recorder.asked) == ASK_AHEAD, 5)
    hub.reset()  # what a broker reconnection does to the worker's loop
    assert len(recorder.dropped) == ASK_AHEAD


def test_asks_wait_a_turn_while_the_pool_has_tasks_to_write_to_its_children(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead = recorder.make()
    reqs = _queued(slots, _ignore, 3)
    unwritten = ["a task handed to the pool"]
    ahead.install(hub, SlotQueue(slots, _ignore), writes_pending=lambda: bool(unwritten))
    turn(hub, 1)  # this turn's poll writes the task to its child: nothing is asked before it
    assert recorder.asked == []
    unwritten.clear()
    turn(hub, 1)  # the next turn asks, before it polls
    assert recorder.asked == reqs[:ASK_AHEAD]


def test_asks_put_off_for_the_pools_writes_are_not_sent_once_the_loop_closes(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead = recorder.make()
    _queued(slots, _ignore, 3)
    ahead.install(hub, SlotQueue(slots, _ignore), writes_pending=lambda: True)
    turn(hub, 1)
    hub.reset()  # (runs the callbacks it had queued, after telling AskAhead it closed)
    assert recorder.asked == []


def test_a_prefork_pools_unwritten_tasks_are_seen_where_celery_keeps_them() -> None:
    # The pool a prefork worker runs (Celery's TaskPool over billiard's AsynPool), started for
    # real: a rename in Celery would turn the wait for its writes off without a word.
    app = Celery("unwritten", broker="memory://", set_as_current=False)
    pool = TaskPool(limit=1, threads=False, app=app, initargs=(app, "unwritten@test"))
    pool.start()
    try:
        worker = SimpleNamespace(pool=pool)  # (what unwritten_tasks reads of the worker)
        assert unwritten_tasks(worker) is False
        pool._pool.outbound_buffer.append("a task handed to the pool")
        assert unwritten_tasks(worker) is True
        pool._pool.outbound_buffer.clear()
    finally:
        pool.stop()
    assert unwritten_tasks(SimpleNamespace(pool=None)) is False  # solo, threads, ...


def test_nothing_is_asked_ahead_while_slots_free_slowly(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead: AskAhead[str] = AskAhead(recorder.ask, recorder.drop)  # no slot handed out lately
    recorder.ahead = ahead
    _queued(slots, _ignore, 3)
    ahead.install(hub, SlotQueue(slots, _ignore))
    turn(hub, 5)
    assert recorder.asked == []  # a grant would sit idle while long runs hold every slot


def test_a_grant_kept_too_long_for_its_slot_is_given_back(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead = recorder.make(HELD_FOR_AT_MOST)
    reqs = _queued(slots, _ignore, 2)
    ahead.install(hub, SlotQueue(slots, _ignore))
    run_until(hub, lambda: len(recorder.asked) == ASK_AHEAD, 5)
    ahead.sweep()
    assert recorder.dropped == []
    time.sleep(HELD_FOR_AT_MOST)  # (the condition is the time itself)
    ahead.sweep()
    assert sorted(recorder.dropped) == sorted(f"ask-for-{id(r)}" for r in reqs[:ASK_AHEAD])


def test_a_task_not_asked_for_ahead_is_not_asked_again_on_every_turn(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder(asks=False)  # e.g. not guarded, or its key function failed
    ahead = recorder.make()
    _queued(slots, _ignore, 1)
    ahead.install(hub, SlotQueue(slots, _ignore))
    run_until(hub, lambda: len(recorder.asked) == 1, 5)
    turn(hub, 5)
    assert len(recorder.asked) == 1


def test_a_task_asked_for_now_takes_a_free_slot_once_granted(hub: Hub) -> None:
    slots, recorder, ahead = _installed(hub)
    req = object()
    slots._waiting.appendleft((recorder.process_task, (req,), {}))  # first in line, slot free
    assert ahead.ask_now(req)
    assert recorder.asked == [req]
    assert slots.value == 1
    assert recorder.taken == []
    ahead.claim_slot(req)
    assert recorder.taken == [f"ask-for-{id(req)}"]  # the slot, with its ask
    assert slots.value == 0
    assert not slots._waiting


def test_a_granted_task_waits_in_the_queue_while_no_slot_is_free(hub: Hub) -> None:
    slots, recorder, ahead = _installed(hub)
    (req,) = _queued(slots, recorder.process_task, 1)
    assert ahead.ask_now(req)
    ahead.claim_slot(req)
    assert recorder.taken == []
    assert len(slots._waiting) == 1
    slots.release()  # the next slot given back is its
    assert recorder.taken == [f"ask-for-{id(req)}"]


def test_a_granted_task_goes_first_for_the_next_slot(hub: Hub) -> None:
    # A task resumed from parking is put first in the queue before it is asked for; a task
    # granted meanwhile must not wait behind it, holding its permit through another turnover.
    slots, recorder, ahead = _installed(hub)
    resumed, granted = _queued(slots, recorder.process_task, 2)
    assert ahead.ask_now(granted)
    ahead.claim_slot(granted)
    assert recorder.taken == []
    assert [args for _cb, args, _kw in slots._waiting] == [(granted,), (resumed,)]
    slots.release()
    assert recorder.taken == [f"ask-for-{id(granted)}"]


def test_tasks_granted_while_queued_take_the_next_slots_in_the_order_granted(hub: Hub) -> None:
    slots, recorder, ahead = _installed(hub)
    other, first, second = _queued(slots, recorder.process_task, 3)
    for req in (first, second):
        assert ahead.ask_now(req)
    ahead.claim_slot(first)
    ahead.claim_slot(second)
    assert [args for _cb, args, _kw in slots._waiting] == [(first,), (second,), (other,)]
    ahead.claim_slot(second)  # (told again: stays where it is)
    assert [args for _cb, args, _kw in slots._waiting] == [(first,), (second,), (other,)]
    slots.release()
    slots.release()
    assert recorder.taken == [f"ask-for-{id(first)}", f"ask-for-{id(second)}"]


def test_a_task_taken_out_of_the_slot_queue_leaves_no_ask_behind(hub: Hub) -> None:
    slots, recorder, ahead = _installed(hub)
    first, second = _queued(slots, recorder.process_task, 2)
    run_until(hub, lambda: len(recorder.asked) == ASK_AHEAD, 5)
    assert ahead.unqueue(first)  # parked again without a slot
    assert not ahead.unqueue(first)
    assert [args for _cb, args, _kw in slots._waiting] == [(second,)]
    run_until(hub, lambda: second in recorder.asked, 5)  # (first in the queue now)
    ahead.sweep()
    assert recorder.dropped == []  # its ask was acted on, not given up
    slots.release()
    assert recorder.taken == [f"ask-for-{id(second)}"]


def test_nothing_is_asked_for_now_where_no_ask_goes_out(hub: Hub) -> None:
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder(asks=False)  # e.g. not guarded: the task is asked for at its slot
    ahead = recorder.make()
    assert not ahead.ask_now(object())  # not installed yet: no slot queue to wait in
    ahead.install(hub, SlotQueue(slots, recorder.process_task))
    req = object()
    assert not ahead.ask_now(req)
    ahead.sweep()
    assert recorder.asked == [req]
    assert recorder.dropped == []


class _Consumer:
    def __init__(self) -> None:
        self.connection = object()
        self.qos = QoS(lambda prefetch_count: None, 4)


class _Controller:
    """What ParkingLot reads of a prefork worker: its slot semaphore and timer (real ones)."""

    def __init__(self, hub: Hub, slots: LaxBoundedSemaphore) -> None:
        self.hub, self.timer, self.semaphore = hub, hub.timer, slots
        self.consumer = _Consumer()
        self.process_task = self._process_task_sem = _ignore


def test_a_queued_task_whose_ask_was_given_up_gets_a_free_slot(hub: Hub) -> None:
    # Asked for while a slot was free, unanswered for too long (a slow Redis): the ask is
    # given up, and the task is handed the free slot (asked for there), not left queued.
    slots = LaxBoundedSemaphore(1)
    recorder = _Recorder()
    ahead = recorder.make(held_for_at_most=0.0)
    ahead.install(hub, SlotQueue(slots, recorder.process_task))
    req = object()
    slots._waiting.appendleft((recorder.process_task, (req,), {}))
    assert ahead.ask_now(req)
    ahead.sweep()
    assert recorder.dropped == [f"ask-for-{id(req)}"]
    assert recorder.taken == [None]  # its slot, with no ask: asked for there
    assert slots.value == 0


def test_a_task_answered_while_it_is_asked_for_now_takes_one_slot_once(hub: Hub) -> None:
    # The answer is called back before the ask returns (a client that waits for its reply,
    # or a failed connection) and hands the task its slot there and then.
    slots = LaxBoundedSemaphore(2)
    recorder = _Recorder()
    ahead = recorder.make()
    took_slot: list[object] = []

    def process_task(req: object) -> None:
        took_slot.append(req)
        recorder.process_task(req)

    queue = SlotQueue(slots, process_task)  # (the lot and AskAhead share the worker's slots)
    ahead.install(hub, queue)
    lot = ParkingLot(_Controller(hub, slots), queue, ahead.ask_now)
    req = _Req("t-2")
    recorder.then = lambda: ahead.claim_slot(req)  # granted at once
    parked = Parked(req, "a", 1, 1, 0, None, time.monotonic())
    lot.park(parked, 60.0, slot_taken=False)
    lot.wake(parked)
    assert took_slot == [req]  # once, not again when the ask returns
    assert slots.value == 1
    assert not slots._waiting


@pytest.mark.parametrize("asked_first", [True, False])
def test_a_parked_task_resuming_while_a_slot_is_free_is_asked_for_before_taking_it(
    hub: Hub, asked_first: bool
) -> None:
    slots = LaxBoundedSemaphore(1)
    took_slot: list[object] = []
    queue = SlotQueue(slots, took_slot.append)
    lot = ParkingLot(_Controller(hub, slots), queue, lambda req: asked_first)
    req = _Req("t-1")
    parked = Parked(req, "a", 3, 1, 0, None, time.monotonic())
    lot.park(parked, 60.0, slot_taken=False)  # parked again without a slot: none given back
    assert slots.value == 1
    lot.wake(parked)
    if asked_first:  # its slot waits for the answer; nothing else is held up meanwhile
        assert took_slot == []
        assert slots.value == 1
        assert [args for _cb, args, _kw in slots._waiting] == [(req,)]
    else:  # no ask went out: the slot is taken, and the task is asked for there
        assert took_slot == [req]
        assert slots.value == 0
        assert not slots._waiting


# -- real workers ---------------------------------------------------------------------------------


def _one_slot_worker(redis_url: str, prefix: str, tmp_path: Path, queue: str) -> WorkerProcess:
    return WorkerProcess(
        redis_url, prefix, queue, 1, tmp_path / f"{queue}.log", "-Q", queue,
        conf={"redsem_lease": 30.0},
    )  # fmt: skip


def _two_held_at_once(sem: Any, within: float) -> list[tuple[str, int]]:
    """Watch ``sem`` for up to ``within`` seconds for two holders at once; their ids and
    fencing tokens (a worker with one slot holds two only when it asked ahead)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        holders = sem.holders()
        if len(holders) >= 2:
            return [(h.permit_id, h.token) for h in holders]
    return []


@pytest.mark.slow
def test_a_task_queued_for_the_slot_holds_its_permit_before_the_slot_frees(
    app: Celery, redis_url: str, module_prefix: str, tmp_path: Path, key: str
) -> None:
    # One slot, a stream of short runs on one key (limit 3): while one runs, the next in the
    # slot queue is granted ahead, so two permits are held at once now and then. (Runs of
    # 50 ms: asks go ahead only while slots turn over within about SLOT_SOON / 2 on average,
    # and on a loaded host 100 ms runs plus a child's overhead did not, for all 30 of them.)
    queue = f"ahead-{key}"
    worker = _one_slot_worker(redis_url, module_prefix, tmp_path, queue)
    try:
        worker.wait_ready()
        sem = holder(app, f"counted:{key}", 3)
        results = [app.tasks["t.counted"].apply_async((key, 0.05), queue=queue) for _ in range(60)]
        assert _two_held_at_once(sem, 20), "no permit was granted ahead of its slot"
        outs = [result.get(timeout=30) for result in results]
        assert all(out["contention_retries"] == 0 for out in outs)
        assert int(app.backend.client.get(f"{app.conf.redsem_key_prefix}:t:max:{key}")) == 1
        wait_until(lambda: sem.holders() == [], 5, what="every permit given back")
    finally:
        worker.stop()


# -- the prefetch window of parked tasks ----------------------------------------------------------


def test_the_window_follows_parked_tasks_one_by_one_where_kombu_keeps_it() -> None:
    redis_broker = Connection("redis://127.0.0.1:1/0")  # (never connected)
    rabbitmq = Connection("amqp://guest:guest@127.0.0.1:1//")
    assert window_step(redis_broker) == 1
    assert window_step(rabbitmq) == WINDOW_STEP
    qos = QoS(lambda prefetch_count: None, 16)
    for change, value in ((1, 17), (1, 18), (-1, 17), (-1, 16)):
        widen_for_parked(qos, change, 1)
        assert qos.value == value


def test_the_prefetch_window_widens_for_parked_tasks_in_steps_and_narrows_back() -> None:
    sent: list[int] = []

    def set_prefetch_count(prefetch_count: int) -> None:  # what the consumer tells the broker
        sent.append(prefetch_count)

    qos = QoS(set_prefetch_count, 16)
    qos.update()
    for _ in range(20):  # 20 tasks parked, one after the other
        widen_for_parked(qos, 1, WINDOW_STEP)
        qos.update()  # as the worker's event loop does on every turn
    assert qos.value >= 16 + 20  # room for every parked task beside the 16 it had
    assert qos.value <= 16 + 20 + WINDOW_STEP
    assert len(sent) == 1 + 3  # three changes told to the broker, not twenty
    for _ in range(19):
        widen_for_parked(qos, -1, WINDOW_STEP)
        qos.update()
    assert 16 + 1 <= qos.value <= 16 + 1 + 2 * WINDOW_STEP
    widen_for_parked(qos, -1, WINDOW_STEP)  # the last one resumes: the window is as it was
    qos.update()
    assert qos.value == 16
    assert len(sent) < 1 + 3 + 5


def test_the_line_index_stays_small_however_often_tasks_park_again() -> None:
    tasks = ParkedTasks()
    stays = _parked("a", 1)
    tasks.add(stays)
    for _ in range(2_000):  # one task parked and resumed again and again beside it
        again = _parked("a", 5)
        tasks.add(again)
        tasks.remove(again.req)
    assert len(tasks._heads["a"]) <= 2 * 1 + 16 + 1
    assert tasks.first_in_line("a") is stays


def test_the_window_comes_back_to_its_size_when_kombu_caps_it() -> None:
    # With worker_eta_task_limit kombu caps the window: a widening may apply only in part.
    qos = QoS(lambda prefetch_count: None, 4, max_prefetch=6)
    for _ in range(3):
        widen_for_parked(qos, 1, WINDOW_STEP)
    assert qos.value == 6
    for _ in range(3):
        widen_for_parked(qos, -1, WINDOW_STEP)
    assert qos.value == 4


def test_an_ask_that_never_went_out_is_not_waited_for(hub: Hub) -> None:
    # Admission registers its ask ahead just before sending it; if the send fails, it says so,
    # and the task is asked for when it takes its slot instead of waiting for an answer.
    _slots, _recorder, ahead = _installed(hub, 1)
    req = object()
    ahead._asked[req] = (time.monotonic(), None)  # (as _send does before asking)
    ahead.sent(req, "ask")
    ahead.unsent(req)
    assert ahead.take(req) is None
