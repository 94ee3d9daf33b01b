"""Behaviour of guarded tasks in a real in-process worker (threads pool) on the test server."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from celery.app.task import Context
from celery.signals import task_postrun, task_retry

from celery_redsem import AcquireTimeout, KeyFunctionError, read_state
from celery_redsem.integration.guards.base import guards_of
from celery_redsem.integration.wire import WAIT_HEADER
from tests.integration.conftest import blocked, close_app, forged_grant_runs_nothing, holder
from tests.servers import wait_until


@pytest.fixture(scope="module")
def events() -> Iterator[dict[str, Counter[str]]]:
    """Per task id: how many times each state ended a run (postrun) and how many retries."""
    seen: dict[str, Counter[str]] = {}
    lock = threading.Lock()

    def on_postrun(task_id: str = "", state: str | None = None, **_: object) -> None:
        with lock:
            seen.setdefault(task_id, Counter())[str(state)] += 1

    def on_retry(request: object = None, **_: object) -> None:
        with lock:
            seen.setdefault(getattr(request, "id", ""), Counter())["retry-signal"] += 1

    task_postrun.connect(on_postrun, weak=False)
    task_retry.connect(on_retry, weak=False)
    yield seen
    task_postrun.disconnect(on_postrun)
    task_retry.disconnect(on_retry)


def test_body_sees_its_permit_and_it_is_released(app: Celery, worker: object, key: str) -> None:
    out = app.tasks["t.locked"].delay(key, 0.01).get(timeout=10)
    assert out["name"] == f"locked:{key}"
    assert out["token"] > 0
    assert not out["lost"]
    assert out["same_as_request"]  # self.request.redsem_permit is current_permit()
    state = holder(app, f"locked:{key}").state()
    assert state.holders == []
    assert state.waiters == []


def test_key_gets_arguments_by_name_positional_or_keyword(
    app: Celery, worker: object, key: str
) -> None:
    by_position = app.tasks["t.counted"].delay(key, 0.01).get(timeout=10)
    by_keyword = (
        app.tasks["t.counted"].apply_async(kwargs={"seconds": 0.01, "key": key}).get(timeout=10)
    )
    assert by_position["name"] == by_keyword["name"] == f"counted:{key}"


def test_contention_retries_keep_the_place_and_spare_max_retries(
    app: Celery, worker: object, key: str, events: dict[str, Counter[str]]
) -> None:
    sem, blocker = blocked(app, f"locked:{key}")
    result = app.tasks["t.locked"].delay(key)  # max_retries=0
    wait_until(
        lambda: [w.permit_id for w in sem.state().waiters] == [result.id], 10, what="in line"
    )
    ticket = sem.state().waiters[0].ticket
    wait_until(lambda: events.get(result.id, Counter())["retry-signal"] >= 3, 10, what="3 retries")
    assert result.state in ("RETRY", "STARTED")  # between two tries, or in one: not failed
    assert [(w.permit_id, w.ticket) for w in sem.state().waiters] == [(result.id, ticket)]
    sem.release(blocker)
    out = result.get(timeout=10)
    assert out["retries"] == 0  # the task's own retry count is untouched
    assert out["contention_retries"] >= 3  # more than max_retries=0 would have allowed
    assert app.tasks["t.locked"].max_retries == 0


def test_tasks_waiting_in_their_slots_are_served_in_line_order(
    app: Celery, worker: object, key: str
) -> None:
    """Behind a holder of a known hold time, the next tasks wait in their slots, in order.

    Limit 1, holds of 0.3 s: ``b`` (position 1) and ``c`` (position 2) expect their permits
    within two rounds, so they wait in their worker slots (no retry) and are served in line
    order, each woken by the release before it. ``a`` holds until both are in line.
    """
    fifo = app.tasks["t.fifo"]
    sem = holder(app, f"fifo:{key}")
    assert fifo.delay(key, "warm", 0.3).get(timeout=10)["tag"] == "warm"  # learns the hold
    first = fifo.delay(key, "a", -1)
    wait_until(lambda: [h.permit_id for h in sem.state().holders] == [first.id], 10, what="a")
    later = []
    for tag in "bc":
        later.append(fifo.delay(key, tag, 0.3))
        wait_until(lambda: len(sem.state().waiters) == len(later), 10, what=f"{tag} in line")
    redis.Redis.from_url(app.conf.broker_url).rpush(f"{app.conf.redsem_key_prefix}:t:go:{key}", 1)
    outs = [r.get(timeout=20) for r in (first, *later)]
    assert [out["tag"] for out in outs] == ["a", "b", "c"]
    assert [out["contention_retries"] for out in outs] == [0, 0, 0]  # waited in their slots
    order = redis.Redis.from_url(app.conf.broker_url).lrange(
        f"{app.conf.redsem_key_prefix}:t:order:{key}", 0, -1
    )
    assert order == [b"warm", b"a", b"b", b"c"]


def test_a_task_behind_a_long_line_is_retried_and_keeps_its_place(
    app: Celery, worker: object, key: str, events: dict[str, Counter[str]]
) -> None:
    """Too far back to wait in its slot, a task retries and keeps its ticket until served."""
    fifo = app.tasks["t.fifo"]
    sem, blocker = blocked(app, f"fifo:{key}")
    ahead = [sem.attempt(f"ahead-{i}", join_line=True, waiter_lease=30) for i in range(3)]
    assert [w.position for w in ahead] == [1, 2, 3]  # type: ignore[union-attr]
    result = fifo.delay(key, "behind")  # position 4 > 2 x limit: no waiting in the slot

    def line() -> list[tuple[str, int]]:
        return [(w.permit_id, w.ticket) for w in sem.state().waiters]

    wait_until(lambda: len(line()) == 4, 10, what="behind in line")
    before = line()
    wait_until(lambda: events.get(result.id, Counter())["retry-signal"] >= 2, 10, what="retries")
    assert line() == before  # same ticket, same order, after its retries
    assert before[-1][0] == result.id
    for waiter in ahead:
        sem.release(waiter.id)
    sem.release(blocker)
    out = result.get(timeout=20)
    assert out["contention_retries"] >= 2
    assert out["retries"] == 0


def test_spent_wait_budget_fails_visibly_and_leaves_the_line(
    app: Celery, worker: object, key: str
) -> None:
    sem, blocker = blocked(app, f"budget:{key}")
    result = app.tasks["t.budget"].delay(key)
    with pytest.raises(AcquireTimeout, match=r"max_wait=0\.5"):
        result.get(timeout=15)
    assert result.state == "FAILURE"
    assert sem.state().waiters == []
    sem.release(blocker)


def test_a_forged_wait_header_neither_lifts_the_budget_nor_stalls_the_worker(
    app: Celery, worker: object, key: str
) -> None:
    # A wait that "began" in the future, after 10**12 retries: the budget still runs out, and
    # the backoff (2 ** retries) is computed from a bounded count.
    sem, blocker = blocked(app, f"budget:{key}")
    forged = [10**12, 10**15, 0, 10**12, 0, 0]
    result = app.tasks["t.budget"].apply_async((key,), headers={WAIT_HEADER: forged})
    with pytest.raises(AcquireTimeout, match=r"max_wait=0\.5"):
        result.get(timeout=15)
    assert sem.state().waiters == []
    sem.release(blocker)


@pytest.mark.parametrize(
    ("mode", "fragment"),
    [
        ("raise", "raised RuntimeError('key function exploded')"),
        ("exit", "raised SystemExit(3)"),
        ("interrupt", "raised KeyboardInterrupt()"),
        ("none", "returned None"),
        ("int", "returned int 5, not a str"),
        ("huge", "10000 characters long"),
        ("braces", "must not contain '{' or '}'"),
    ],
)
def test_bad_key_fails_visibly_naming_task_and_key(
    app: Celery, worker: object, mode: str, fragment: str, redis_client: redis.Redis
) -> None:
    pattern = f"{app.conf.redsem_key_prefix}:{{*"
    before = set(redis_client.scan_iter(match=pattern, count=500))
    result = app.tasks["t.bad_key"].delay(mode)
    with pytest.raises(KeyFunctionError) as info:
        result.get(timeout=10)
    assert result.state == "FAILURE"
    message = str(info.value)
    assert "task t.bad_key" in message
    assert "key function bad_key (" in message
    assert fragment in message
    assert set(redis_client.scan_iter(match=pattern, count=500)) <= before  # nothing leaked


@pytest.mark.parametrize(
    ("how", "final"),
    [
        ("ok", "SUCCESS"),
        ("raise", "FAILURE"),
        ("retry", "SUCCESS"),
        ("ignore", "IGNORED"),
        ("reject", "REJECTED"),
    ],
)
def test_permit_is_released_on_every_way_out_of_the_body(
    app: Celery, worker: object, key: str, how: str, final: str, events: dict[str, Counter[str]]
) -> None:
    result = app.tasks["t.ways_out"].delay(key, how)
    wait_until(lambda: events.get(result.id, Counter())[final] >= 1, 10, what=f"{how} -> {final}")
    state = holder(app, f"ways:{key}").state()
    assert state.holders == []
    assert state.waiters == []
    if how == "retry":
        assert events[result.id]["RETRY"] == 1
        assert result.get(timeout=5) == "retry:1"


def test_eager_mode_blocks_for_a_bounded_time(redis_url: str, module_prefix: str, key: str) -> None:
    from tests.integration.apps.tasks import make_app

    eager = make_app(redis_url, module_prefix, task_always_eager=True, redsem_eager_timeout=0.3)
    sem, blocker = blocked(eager, f"locked:{key}")
    started = time.monotonic()
    result = eager.tasks["t.locked"].delay(key)
    assert result.state == "FAILURE"
    with pytest.raises(AcquireTimeout, match=r"redsem_eager_timeout=0\.3"):
        result.get()
    assert time.monotonic() - started < 5
    assert [w.permit_id for w in sem.state().waiters] == []  # gave up its place
    sem.release(blocker)
    assert eager.tasks["t.locked"].delay(key).get()["name"] == f"locked:{key}"
    assert eager.tasks["t.locked"].apply(args=(key,)).get()["contention_retries"] == 0
    assert eager.tasks["t.locked"](key)["name"] == f"locked:{key}"  # a direct call
    # ... and .run() (no task on the stack) on this app, which is not the current one.
    assert eager.tasks["t.locked"].run(key)["name"] == f"locked:{key}"
    assert sem.state().holders == []
    close_app(eager)


def test_a_task_calling_itself_runs_inside_its_own_permit(
    app: Celery, worker: object, key: str
) -> None:
    # The nested call inherits the request (same task id): it must neither wait for the
    # permit its caller holds nor give it back when it returns.
    out = app.tasks["t.nested"].delay(key, "itself").get(timeout=10)
    assert out["inner"]["holders"] == [out["id"]]
    assert out["holders"] == [out["id"]]  # still held after the inner call returned
    assert (
        read_state(
            redis.Redis.from_url(app.conf.broker_url),
            f"nested:{key}",
            prefix=app.conf.redsem_key_prefix,
        ).holders
        == []
    )


def test_an_eager_call_on_a_key_its_caller_holds_runs_inside_the_callers_permit(
    redis_url: str, module_prefix: str, key: str
) -> None:
    # In a worker the inner tasks would queue and run after their caller; run inline (eager),
    # waiting for the caller's own permits could only time out. The caller holds two: its
    # lock (the innermost guard) and a limit-5 semaphore (the outermost).
    from tests.integration.apps.tasks import make_app

    eager = make_app(redis_url, module_prefix, task_always_eager=True, redsem_eager_timeout=5)
    try:
        started = time.monotonic()
        out = eager.tasks["t.nested"].delay(key, "delay").get()
        assert out["inner"] == ["ran", "ran too"]
        assert time.monotonic() - started < 4  # not redsem_eager_timeout
        assert out["holders"] == [out["id"]]
        client = redis.Redis.from_url(redis_url)
        assert read_state(client, f"nested:{key}", prefix=module_prefix).holders == []
    finally:
        close_app(eager)


@pytest.mark.parametrize(
    ("how", "inner"),
    [
        ("lost", "PermitLost"),  # the caller's permit was lost: nothing covers the call
        ("thread", ["AcquireTimeout"]),  # a copied context in another thread: not the caller
        ("other_limit", "AcquireTimeout"),  # the same name with another limit: not the same
    ],
)
def test_a_call_the_callers_permit_does_not_cover_asks_for_its_own(
    redis_url: str, module_prefix: str, key: str, how: str, inner: object
) -> None:
    from tests.integration.apps.tasks import make_app

    eager = make_app(redis_url, module_prefix, task_always_eager=True, redsem_eager_timeout=0.5)
    try:
        assert eager.tasks["t.nested"].delay(key, how).get()["inner"] == inner
    finally:
        close_app(eager)


def test_a_task_with_two_guards_holds_both_and_waits_for_the_busy_one(
    app: Celery, worker: object, key: str
) -> None:
    sem, blocker = blocked(app, f"inner:{key}")
    result = app.tasks["t.two_guards"].delay(key)
    wait_until(lambda: result.state == "RETRY", 10, what="a contention retry on the inner lock")
    sem.release(blocker)
    out = result.get(timeout=15)
    assert out["outer"] == [out["id"]]
    assert out["inner"] == [out["id"]]
    assert out["contention_retries"] >= 1
    assert holder(app, f"outer:{key}", 2).state().holders == []
    assert sem.state().holders == []


def test_worker_start_gives_guarded_tasks_a_releasing_request(app: Celery, worker: object) -> None:
    from celery.utils.imports import symbol_by_name

    from celery_redsem.integration.worker.request import ReleasingRequest

    assert issubclass(symbol_by_name(app.tasks["t.locked"].Request), ReleasingRequest)


def test_a_forged_grant_header_is_not_trusted(app: Celery, worker: object, key: str) -> None:
    forged_grant_runs_nothing(app, key)  # threads pool: nothing is parked, the header still goes


def test_a_release_whose_key_function_fails_is_logged_as_a_warning(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # After a child died the main process works out the semaphore again to release the
    # permit; if it cannot, the permit stays held until its lease ends, which the log says.
    (guard,) = guards_of(app.tasks["t.bad_key"])
    with caplog.at_level(logging.WARNING, logger="celery_redsem"):
        request = Context({"id": "run-1", "args": ["raise"], "kwargs": {}})
        assert guard.release_run(app.tasks["t.bad_key"], request) is False
    (record,) = [r for r in caplog.records if "run-1" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "key function exploded" in record.getMessage()
    assert "frees when its lease ends" in record.getMessage()


def test_a_send_that_ignores_the_result_still_does_after_a_contention_retry(
    app: Celery, worker: object, key: str, events: dict[str, Counter[str]]
) -> None:
    # The retry is a new message made from the run's request; Celery before 5.7 leaves the
    # sender's ignore_result out of it, and the retried run stored its result.
    sem, blocker = blocked(app, f"locked:{key}")
    result = app.tasks["t.locked"].apply_async((key,), ignore_result=True)
    try:
        wait_until(
            lambda: events.get(result.id, Counter())["retry-signal"] >= 1, 10, what="a retry"
        )
    finally:
        sem.release(blocker)
    wait_until(lambda: events.get(result.id, Counter())["SUCCESS"] >= 1, 20, what="the run")
    assert app.backend.get_task_meta(result.id)["status"] != "SUCCESS"
