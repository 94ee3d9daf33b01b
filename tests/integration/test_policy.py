"""When a task waits in its slot, its countdowns, and how late retries are expected back."""

from __future__ import annotations

import random

import pytest

from celery_redsem.integration.policy import (
    DEFAULT_RETURN_DELAY,
    HoldTimes,
    ReturnDelays,
    contention_countdown,
    error_countdown,
    head_wait_budget,
)

BASE = {"backoff": 0.25, "backoff_max": 10.0, "floor": 0.02}


def test_without_an_estimate_it_is_celerys_capped_exponential_backoff() -> None:
    exact = [
        contention_countdown(
            attempt=n, position=50, limit=3, hold_estimate=None, jitter=False, **BASE
        )
        for n in range(8)
    ]
    assert exact == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    jittered = [
        contention_countdown(
            attempt=3, position=50, limit=3, hold_estimate=None, jitter=True, **BASE
        )
        for _ in range(200)
    ]
    assert all(0.02 <= c <= 2.0 for c in jittered)
    assert len(set(jittered)) > 50


def test_with_an_estimate_it_tracks_the_time_to_the_head_of_the_line() -> None:
    rng = random.Random(1)

    def countdown(position: int) -> float:
        return contention_countdown(
            attempt=0, position=position, limit=3, hold_estimate=0.3, jitter=True, rng=rng, **BASE
        )

    for position in (4, 10, 31):
        expected = (position - 3) / 3 * 0.3
        assert 0.7 * expected - 1e-9 <= countdown(position) <= expected + 1e-9
    assert countdown(1) <= 0.1  # next in line: back soon
    assert countdown(10_000) == 10.0  # capped


def test_hold_times_average_per_task_and_stay_bounded() -> None:
    times = HoldTimes(weight=0.5, max_names=2)
    assert times.estimate("a") is None
    times.observe("a", 1.0)
    times.observe("a", 3.0)
    assert times.estimate("a") == 2.0
    times.observe("b", 1.0)
    times.observe("c", 1.0)
    assert times.estimate("a") is None
    assert times.estimate("c") == 1.0


def test_after_a_redis_error_it_is_celerys_capped_exponential_backoff() -> None:
    exact = [
        error_countdown(attempt=n, backoff=0.25, backoff_max=2.0, jitter=False, floor=0.02)
        for n in range(6)
    ]
    assert exact == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert error_countdown(attempt=0, backoff=0.0, backoff_max=2.0, jitter=False, floor=0.02) == (
        0.02
    )


@pytest.mark.parametrize(
    ("position", "hold", "expected"),
    [
        (1, 0.06, 0.09),  # next release in ~20 ms, or a whole hold if the holders began together
        (1, 0.01, 0.05),  # the shortest wait worth trying
        (3, 0.06, 0.12),  # twice the expected 60 ms
        (6, 0.06, 0.24),  # two rounds of permits away: still waits
        (7, 0.06, 0.0),  # further back: retried
        (1, 5.0, 0.0),  # a permit ~1.7 s away is not worth a slot for 1 s: retried
        (3, None, 1.0),  # no hold seen yet: within the next round, waits up to head_wait
        (4, None, 0.0),
        (0, 0.06, 0.0),  # not in line
    ],
)
def test_waits_in_the_slot_only_for_a_permit_that_is_near(
    position: int, hold: float | None, expected: float
) -> None:
    budget = head_wait_budget(position=position, limit=3, hold_estimate=hold, head_wait=1.0)
    assert budget == pytest.approx(expected)


def test_head_wait_zero_never_waits_and_caps_every_wait() -> None:
    assert head_wait_budget(position=1, limit=3, hold_estimate=0.06, head_wait=0.0) == 0.0
    assert head_wait_budget(position=1, limit=3, hold_estimate=None, head_wait=0.0) == 0.0
    assert head_wait_budget(position=2, limit=1, hold_estimate=0.4, head_wait=1.0) == 1.0


def test_return_delays_are_an_upper_estimate_per_queue() -> None:
    delays = ReturnDelays(weight=0.5, max_names=2)
    assert delays.estimate("celery") == DEFAULT_RETURN_DELAY  # nothing seen: assume late
    for _ in range(20):
        delays.observe("celery", 0.4)
    assert delays.estimate("celery") == pytest.approx(0.4, abs=1e-3)  # steady: the delay itself
    delays.observe("celery", 0.0)
    delays.observe("celery", 0.8)
    assert delays.estimate("celery") > 0.6  # jittery: above the average
    delays.observe("other", -1.0)  # early (clock rounding) counts as on time
    assert delays.estimate("other") == 0.0
    delays.observe("third", 0.1)
    assert delays.estimate("celery") == DEFAULT_RETURN_DELAY  # bounded: oldest forgotten
