"""Contention countdowns: Celery's backoff without a hold estimate, position-based with one."""

from __future__ import annotations

import random

from celery_redsem.backoff import HoldTimes, contention_countdown

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
