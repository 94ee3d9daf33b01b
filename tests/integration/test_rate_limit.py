"""``@with_rate_limit`` under Celery: eager calls, an in-process worker (threads pool: no
admission, refused runs retried through the broker), and (slow) two real prefork workers
holding a per-key rate together (issue 22's acceptance; its timing figures are the benchmark's,
``benchmarks/rate/``: the bounds here are loose, the rate bounds strict)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import task_retry

from celery_redsem import (
    AcquireTimeout,
    ConfigurationError,
    RateLimiter,
    get_client,
    read_state,
    with_rate_limit,
)
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.integration.guards.base import guards_of
from celery_redsem.integration.guards.rate_guard import RateGuard
from celery_redsem.integration.guards.semaphore_guard import SemaphoreGuard
from tests.integration.apps.rate_tasks import (
    STACK_BURST,
    STACK_LIMIT,
    STACK_RATE,
    Start,
    add_rate_tasks,
    make_rate_app,
    make_rate_only_app,
    read_starts,
)
from tests.integration.apps.tasks import make_app
from tests.integration.conftest import WorkerProcess, close_app

TICK_RATE = 20.0  # r.tick's rate, burst 1


@pytest.fixture(scope="module")
def app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    """The test app with the ``r.*`` tasks (the in-process ``worker`` fixture runs it)."""
    application = make_rate_app(redis_url, module_prefix)
    yield application
    close_app(application)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def _starts(app: Celery, client: redis.Redis, key: str) -> list[Start]:
    return read_starts(client, app.conf.redsem_key_prefix, key)


def _admissions(app: Celery | str, client: redis.Redis, name: str) -> list[float]:
    """Server times (seconds) at which the limiter ``name`` (of ``app``, or under the prefix
    ``app``) admitted a run: its line keeps each admitted id, scored minus its admission time
    (microseconds), for a minute."""
    prefix = app if isinstance(app, str) else app.conf.redsem_key_prefix
    line = SemaphoreKeys(prefix, name).rate_line
    return sorted(
        -score / 1e6 for _, score in client.zrange(line, 0, -1, withscores=True) if score < 0
    )


def _most_in_a_second(times: list[float]) -> int:
    return max((sum(1 for t in times[i:] if t - s < 1.0) for i, s in enumerate(times)), default=0)


def _assert_rate_bound(times: list[float], rate: float, burst: int, slack: int = 0) -> None:
    """Between any two of ``times`` (both counted) at most ``burst + span x rate`` (+ ``slack``):
    the GCRA bound, over every window at once."""
    times = sorted(times)
    for i, j in itertools.combinations_with_replacement(range(len(times)), 2):
        allowed = burst + (times[j] - times[i]) * rate + slack
        assert j - i + 1 <= allowed + 1e-3, f"{j - i + 1} in {times[j] - times[i]:.3f}s"


#: Seconds by which a run sent later may start before one sent earlier and still count as in
#: order: a pool child starved of CPU for a moment on a loaded host starts its body late
#: (inversions within it reached 0.12-0.22 of the pairs under load 5-9, none in a quiet run).
ORDER_SLACK = 0.3


def _inverted(starts: list[Start], slack: float = 0.0) -> float:
    """The fraction of pairs of runs that started in the opposite order to the one sent, by
    more than ``slack`` seconds."""
    pairs = list(itertools.combinations(sorted(starts, key=lambda s: s.n), 2))
    return sum(a.at - b.at > slack for a, b in pairs) / max(1, len(pairs))


def _most_inverted_in_a_worker(starts: list[Start]) -> float:
    """:func:`_inverted` of each worker's own runs, the largest. A worker books each run's
    slot in the order the broker delivered it; across workers the order is the order in which
    they booked, which a worker starved of CPU for a moment (a loaded CI host) delays."""
    workers = {s.worker for s in starts}
    return max(
        _inverted([s for s in starts if s.worker == worker], ORDER_SLACK) for worker in workers
    )


def test_bad_arguments_fail_at_decoration() -> None:
    def task(account_id: int) -> None: ...

    def misspelt(account: int) -> str:
        return f"a:{account}"

    with pytest.raises(ConfigurationError, match=r"rate of .*rate must be"):
        with_rate_limit("10/w", key="k")(task)
    with pytest.raises(ConfigurationError, match="burst of"):
        with_rate_limit("10/s", key="k", burst=0)(task)
    with pytest.raises(ConfigurationError, match="asks for 'account'"):
        with_rate_limit("10/s", key=misspelt)(task)
    sample = Celery("sample", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"above @app\.task"):
        with_rate_limit("10/s", key="k")(sample.task(task))


def test_stacked_guards_are_both_found(app: Celery) -> None:
    for name in ("r.rate_over_sem", "r.sem_over_rate"):
        task = app.tasks[name]
        assert len(guards_of(task, SemaphoreGuard)) == 1
        assert len(guards_of(task, RateGuard)) == 1
    assert guards_of(app.tasks["r.tick"], RateGuard)[0].rate == TICK_RATE
    assert guards_of(app.tasks["r.tick"], SemaphoreGuard) == []


def test_eager_calls_sleep_until_their_slot(app: Celery, client: redis.Redis, key: str) -> None:
    assert [app.tasks["r.tick"].apply(args=(key, n)).get() for n in range(4)] == [0, 1, 2, 3]
    starts = [s.at for s in _starts(app, client, key)]
    assert len(starts) == 4
    _assert_rate_bound(_admissions(app, client, f"rate:{key}"), TICK_RATE, 1)
    _assert_rate_bound(starts, TICK_RATE, 1, slack=1)


def test_an_eager_call_gives_up_after_the_eager_timeout(
    redis_url: str, module_prefix: str, key: str
) -> None:
    short = make_app(redis_url, module_prefix, redsem_eager_timeout=0.1)
    add_rate_tasks(short, redis_url, module_prefix)
    try:
        ahead = RateLimiter(get_client(short), f"rate:{key}", "20/s", prefix=module_prefix)
        for n in range(10):  # half a second of slots booked by others
            ahead.attempt(f"other-{n}", book=True)
        with pytest.raises(AcquireTimeout, match="redsem_eager_timeout"):
            short.tasks["r.tick"].apply(args=(key,)).get()
        assert ahead.state().booked == 9  # it booked nothing
    finally:
        close_app(short)


def test_a_worker_retries_refused_runs_with_the_exact_countdown(
    app: Celery, worker: Any, client: redis.Redis, key: str
) -> None:
    """Threads pool (no admission): a refused run is re-published with a countdown of exactly
    the time to the slot booked for it, which it keeps, and is admitted when it is back
    (max_retries=0, and all succeed)."""
    name = f"rate:{key}"
    line = SemaphoreKeys(app.conf.redsem_key_prefix, name).rate_line
    seen: dict[str, tuple[float, float]] = {}  # permit id: its countdown, its slot ahead

    def on_retry(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == "r.tick" and request.args[0] == key:
            permit_id = permit_id_of(request)
            slot_us = client.zscore(line, permit_id)  # still booked, not yet run
            seconds, micros = client.time()
            to_slot = (slot_us - seconds * 1_000_000 - micros) / 1e6 if slot_us else -1.0
            seen[permit_id] = (float(reason.when), to_slot)

    runs = 24  # slots up to 1.15 s ahead
    task_retry.connect(on_retry, weak=False)
    try:
        results = [app.tasks["r.tick"].delay(key, n) for n in range(runs)]
        assert [r.get(timeout=30) for r in results] == list(range(runs))
    finally:
        task_retry.disconnect(on_retry)
    starts = _starts(app, client, key)
    assert len(starts) == runs
    assert {s.retries for s in starts} == {0}  # max_retries=0 never spent
    # About one trip through the broker each: back at its slot, a run is admitted at once
    # (unless a run before it came back late: the rate then pushes the later slots back).
    trips = sum(s.trips for s in starts)
    assert runs - 5 <= trips <= runs  # up to 50 ms is waited in a slot instead
    assert len(seen) == trips
    # Slots far ahead got countdowns as long (a slow host books the last runs a little later).
    assert max(countdown for countdown, _ in seen.values()) > 0.5
    for countdown, to_slot in seen.values():
        # The countdown was taken just before the handler read the slot: a little more.
        assert 0 <= countdown - to_slot < 0.3, (countdown, to_slot)
    _assert_rate_bound(_admissions(app, client, name), TICK_RATE, 1)
    _assert_rate_bound([s.at for s in starts], TICK_RATE, 1, slack=1)


def _check_stacked(app: Celery, client: redis.Redis, task: str, key: str, runs: int) -> None:
    """The runs of one stacked task on ``key``: each bound held, nothing left held."""
    prefix = app.conf.redsem_key_prefix
    tag = {"r.rate_over_sem": "rs", "r.sem_over_rate": "sr"}[task]
    starts = _starts(app, client, key)
    assert len(starts) == runs
    assert {s.retries for s in starts} == {0}
    # The semaphore: never more than its limit at once, and reached (the rate's burst is
    # larger, so without the semaphore more would have run at once).
    assert int(client.get(f"{prefix}:t:max:{key}") or 0) == STACK_LIMIT
    # The rate: admissions obey it; so do the starts where the rate is the inner guard
    # (outermost, an admitted run may still wait for a permit before it starts).
    _assert_rate_bound(_admissions(app, client, f"{tag}:{key}"), STACK_RATE, STACK_BURST)
    if task == "r.sem_over_rate":
        _assert_rate_bound([s.at for s in starts], STACK_RATE, STACK_BURST, slack=1)
    state = read_state(client, f"{tag}:{key}", prefix=prefix)
    assert (state.holders, state.waiters) == ([], [])


STACKED_RUNS = 10  # the semaphore alone would start these within 0.6 s: above the rate


def test_stacked_guards_apply_both_in_a_worker(
    app: Celery, worker: Any, client: redis.Redis
) -> None:
    keys = {task: uuid.uuid4().hex[:10] for task in ("r.rate_over_sem", "r.sem_over_rate")}
    results = [
        app.tasks[task].delay(key, n) for n in range(STACKED_RUNS) for task, key in keys.items()
    ]
    assert sorted(r.get(timeout=30) for r in results) == sorted(list(range(STACKED_RUNS)) * 2)
    for task, key in keys.items():
        _check_stacked(app, client, task, key, STACKED_RUNS)


def _delete_prefix(client: redis.Redis, prefix: str) -> None:
    for stale in client.scan_iter(match=f"{prefix}:*", count=500):
        client.delete(stale)


@pytest.fixture(scope="module")
def prefork_app(redis_url: str, module_prefix: str) -> Iterator[Celery]:
    """The app of the two prefork workers, under a prefix of its own: the in-process worker
    of the tests above (module-scoped) must not take their tasks."""
    prefix = f"{module_prefix}-prefork"
    application = make_rate_app(redis_url, prefix)
    yield application
    close_app(application)
    client = redis.Redis.from_url(redis_url)
    _delete_prefix(client, prefix)
    client.close()


@pytest.fixture(scope="module")
def workers(redis_url: str, prefork_app: Celery, tmp_path_factory: Any) -> Iterator[None]:
    """Two real prefork workers, ``-c 4`` each, running the ``r.*`` tasks of ``prefork_app``."""
    logs: Path = tmp_path_factory.mktemp("rate-workers")
    procs = [
        WorkerProcess(
            redis_url,
            prefork_app.conf.redsem_key_prefix,
            name,
            4,
            logs / f"{name}.log",
            app_module="tests.integration.apps.rate_worker_app",
        )
        for name in ("ra", "rb")
    ]
    try:
        for proc in procs:
            proc.wait_ready()
        yield
    finally:
        for proc in procs:
            proc.begin_stop()
        for proc in procs:
            proc.stop()


@pytest.mark.slow
def test_two_workers_hold_each_keys_rate(
    prefork_app: Celery, workers: None, client: redis.Redis
) -> None:
    """Issue 22's acceptance through two prefork workers: 120 runs on "hot" and 30 on "cold",
    both at 20/s. Each key's admissions keep the rate exactly (at most 20 in any second), its
    starts within one (20 + burst 1); nothing fails with max_retries=0; refused runs are parked
    by admission (no trip through the broker); the cold key is done long before the hot one;
    each worker's runs of a key start about in the order sent. (The hot key's 1.15 x its ideal
    is measured by ``make bench-rate``: the time bounds here hold on a loaded CI machine.)"""
    hot, cold = f"hot-{uuid.uuid4().hex[:6]}", f"cold-{uuid.uuid4().hex[:6]}"
    tick = prefork_app.tasks["r.tick"]
    sent = [tick.delay(hot, n) for n in range(120)]
    sent += [tick.delay(cold, n) for n in range(30)]
    assert [r.get(timeout=60) for r in sent] == [*range(120), *range(30)]
    hot_starts, cold_starts = _starts(prefork_app, client, hot), _starts(prefork_app, client, cold)
    assert (len(hot_starts), len(cold_starts)) == (120, 30)
    for key, starts in ((hot, hot_starts), (cold, cold_starts)):
        admitted = _admissions(prefork_app, client, f"rate:{key}")
        assert len(admitted) == len(starts)
        assert _most_in_a_second(admitted) <= 20
        _assert_rate_bound(admitted, TICK_RATE, 1)
        assert _most_in_a_second([s.at for s in starts]) <= 21
        assert {s.retries for s in starts} == {0}
        assert sum(s.trips for s in starts) == 0, "a refused run went through the broker"
        assert _most_inverted_in_a_worker(starts) < 0.1, "runs started far from the order sent"
    # Ideals: 5.95 s from the hot key's first start to its last, 1.45 s for the cold key.
    hot_span = hot_starts[-1].at - hot_starts[0].at
    assert hot_span < 2 * 5.95, f"hot key: {hot_span:.2f}s from its first start to its last"
    assert cold_starts[-1].at - hot_starts[0].at < 2 * 1.45 + 1, "the hot key slowed the cold one"


@pytest.mark.slow
def test_two_workers_apply_stacked_guards(
    prefork_app: Celery, workers: None, client: redis.Redis
) -> None:
    """Both orders of ``@with_rate_limit`` and ``@with_semaphore`` through the prefork
    workers (admission leaves a task with two guards to its child): both bounds hold, and no
    permit is left held or waiting."""
    keys = {task: uuid.uuid4().hex[:10] for task in ("r.rate_over_sem", "r.sem_over_rate")}
    results = [
        prefork_app.tasks[task].delay(key, n)
        for n in range(STACKED_RUNS)
        for task, key in keys.items()
    ]
    assert sorted(r.get(timeout=60) for r in results) == sorted(list(range(STACKED_RUNS)) * 2)
    for task, key in keys.items():
        _check_stacked(prefork_app, client, task, key, STACKED_RUNS)


@pytest.mark.slow
def test_a_worker_with_only_rate_limits_parks_refused_runs(
    redis_url: str, module_prefix: str, client: redis.Redis, tmp_path: Path
) -> None:
    """A worker whose app has no semaphore, only ``@with_rate_limit``: admission is installed
    all the same, and parks refused runs until their slot (no trip through the broker)."""
    prefix, key = f"{module_prefix}-rate-only", uuid.uuid4().hex[:10]
    worker = WorkerProcess(
        redis_url,
        prefix,
        "rate-only",
        2,
        tmp_path / "rate-only.log",
        app_module="tests.integration.apps.rate_worker_app",
        env={"REDSEM_TEST_RATE_ONLY": "1"},
    )
    sender = make_rate_only_app(redis_url, prefix)
    try:
        worker.wait_ready()
        results = [sender.tasks["r.tick"].delay(key, n) for n in range(10)]
        assert [r.get(timeout=30) for r in results] == list(range(10))
        starts = read_starts(client, prefix, key)
        admitted = _admissions(prefix, client, f"rate:{key}")
    finally:
        worker.stop()
        close_app(sender)
        _delete_prefix(client, prefix)
    assert len(starts) == len(admitted) == 10
    assert sum(s.trips for s in starts) == 0, "a refused run went through the broker"
    _assert_rate_bound(admitted, TICK_RATE, 1)
