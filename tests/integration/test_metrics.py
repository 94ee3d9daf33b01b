"""Prometheus metrics (``celery_redsem[metrics]``) move as guarded tasks run on an in-process
worker (threads pool), so the registry read here is the one the tasks count in."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_redsem import AcquireTimeout, metrics
from tests.integration.conftest import blocked, holder
from tests.servers import wait_until


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """Metrics on, in a registry of this test's own; off again afterwards."""
    registry = CollectorRegistry()
    metrics.enable_metrics(registry)
    yield registry
    metrics.disable_metrics()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(f"redsem_{name}", labels) or 0.0


def counted(registry: CollectorRegistry, name: str, expected: float, **labels: str) -> None:
    """Wait (briefly) for ``name`` to reach ``expected``: a run's end is counted as the worker
    finishes it, which may be just after its result can be read."""

    def samples() -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples]

    try:
        wait_until(lambda: value(registry, name, **labels) == expected, 5, what=name)
    except AssertionError:
        raise AssertionError(
            f"{name}{labels} is {value(registry, name, **labels)}, not {expected}: {samples()}"
        ) from None


def test_grants_waits_and_the_wait_histogram_move(
    app: Celery, worker: object, key: str, registry: CollectorRegistry
) -> None:
    sem, blocker = blocked(app, f"locked:{key}")
    result = app.tasks["t.locked"].delay(key)
    wait_until(
        lambda: value(registry, "waits_total", task="t.locked", how="retry") >= 2,
        20,
        what="two contention retries counted",
    )
    assert value(registry, "grants_total", task="t.locked") == 0
    sem.release(blocker)
    result.get(timeout=20)
    counted(registry, "grants_total", 1, task="t.locked")
    assert value(registry, "wait_seconds_count", task="t.locked") == 1
    assert value(registry, "wait_seconds_sum", task="t.locked") > 0  # it waited for the lock
    assert value(registry, "timeouts_total", task="t.locked") == 0

    app.tasks["t.locked"].delay(key).get(timeout=20)  # no wait now
    counted(registry, "grants_total", 2, task="t.locked")
    fast = value(registry, "wait_seconds_bucket", task="t.locked", le="1.0")
    assert fast >= 1  # the uncontended grant is in the lowest buckets


def test_a_grant_given_back_for_the_next_guard_counts_once(
    app: Celery, worker: object, key: str, registry: CollectorRegistry
) -> None:
    """The outer semaphore grants, the inner lock is held by the test, so the run gives the
    outer permit back and retries, again and again: each semaphore counts one grant, for the
    run that ran."""
    sem, blocker = blocked(app, f"inner:{key}")
    result = app.tasks["t.two_guards"].delay(key)
    wait_until(
        lambda: value(registry, "waits_total", task="t.two_guards", how="retry") >= 3,
        20,
        what="three contention retries, each after an outer grant",
    )
    assert value(registry, "grants_total", task="t.two_guards") == 0
    sem.release(blocker)
    result.get(timeout=20)
    counted(registry, "grants_total", 2, task="t.two_guards")  # outer and inner
    assert value(registry, "wait_seconds_count", task="t.two_guards") == 2


def test_an_eager_call_counts_its_grant(app: Celery, key: str, registry: CollectorRegistry) -> None:
    app.tasks["t.locked"].apply(args=(key,)).get()
    assert value(registry, "grants_total", task="t.locked") == 1
    assert value(registry, "wait_seconds_count", task="t.locked") == 1


def test_a_timeout_is_counted(
    app: Celery, worker: object, key: str, registry: CollectorRegistry
) -> None:
    sem, blocker = blocked(app, f"budget:{key}")  # t.budget waits at most 0.5 s
    try:
        with pytest.raises(AcquireTimeout):
            app.tasks["t.budget"].delay(key).get(timeout=20)
    finally:
        sem.release(blocker)
    assert value(registry, "timeouts_total", task="t.budget") == 1
    assert value(registry, "grants_total", task="t.budget") == 0


def test_a_lost_lease_is_counted(
    app: Celery, worker: object, key: str, registry: CollectorRegistry
) -> None:
    prefix = app.conf.redsem_key_prefix
    result = app.tasks["t.held_long"].delay(key)
    sem = holder(app, f"long:{key}")
    wait_until(lambda: sem.state().holders, 20, what="the task to hold its lock")
    assert sem.release(sem.state().holders[0].permit_id)  # taken from under it
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        client.rpush(f"{prefix}:t:go:{key}", 1)
    finally:
        client.close()
    assert result.get(timeout=20) == "done"  # "log" policy: the body ran on
    wait_until(
        lambda: value(registry, "lost_leases_total", task="t.held_long") == 1,
        10,
        what="the loss counted",
    )


def test_skips_and_parking_are_counted(registry: CollectorRegistry) -> None:
    metrics.record_skip("t.any")
    metrics.record_park("t.any")
    metrics.record_park("t.any")
    metrics.record_unpark(object())
    metrics.record_unpark(None)  # nothing was parked
    assert value(registry, "skips_total", task="t.any") == 1
    assert value(registry, "waits_total", task="t.any", how="park") == 2
    assert value(registry, "parked_tasks") == 1


def test_enabling_twice_keeps_the_counts_and_disabling_unregisters(
    registry: CollectorRegistry,
) -> None:
    metrics.record_skip("t.any")
    assert metrics.enable_metrics(registry).skips.labels("t.any")._value.get() == 1
    metrics.disable_metrics()
    metrics.record_skip("t.any")  # off: nothing happens
    assert value(registry, "skips_total", task="t.any") == 0


def test_off_by_default_without_importing_prometheus_client() -> None:
    code = (
        "import sys\n"
        "from celery_redsem import metrics\n"
        "metrics.record_skip('t'); metrics.record_wait('t', 'retry'); metrics.record_timeout('t')\n"
        "metrics.record_grant('t', 1.0); metrics.record_unpark(object())\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_metrics_port_already_taken_is_logged_as_well_as_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Raised alone, it vanished in the example's worker_init receiver: Celery's signal
    # dispatch catches it, and the worker printed nothing of it.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError), caplog.at_level(logging.ERROR):
            metrics.serve_metrics(port, "127.0.0.1")
    assert f"cannot serve metrics on 127.0.0.1:{port}" in caplog.text
    assert "Address already in use" in caplog.text
