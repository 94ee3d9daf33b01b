"""The mixed scenario's ideal dispatcher and the limit's own cost, on batches whose answers are
known (no worker: the arithmetic only)."""

from __future__ import annotations

from typing import Any

from benchmarks.celery_e2e.harness import Batch
from benchmarks.celery_e2e.ideal import ideal_schedule
from benchmarks.celery_e2e.scenarios import limit_ceiling, versus_ideal


def _batch(keys: list[str], body: float = 0.1) -> Batch:
    records: list[dict[str, Any]] = [
        {"key": key, "sent": 0.0, "start": 0.0, "end": body, "retries": 0} for key in keys
    ]
    return Batch("fair-0", [0.0] * len(keys), keys, records, 0, len(keys))


def test_the_ideal_starts_the_earliest_sent_task_its_limit_allows() -> None:
    # Two slots, limit 1: the second "a" waits for the first; "b", sent last, takes the free
    # slot at once (work-conserving), ahead of the waiting "a".
    starts = ideal_schedule([0.0, 0.01, 0.02], ["a", "a", "b"], 2, 1, 0.1)
    assert starts == [0.0, 0.1, 0.02]


def test_a_limit_that_binds_costs_the_ideal_its_share_of_the_makespan() -> None:
    # Two slots, limit 1, two tasks of one key: 0.1 s without the limit, 0.2 s with it.
    assert limit_ceiling(versus_ideal(_batch(["a", "a"]), slots=2, limit=1), slots=2) == 0.5


def test_a_limit_that_never_binds_costs_nothing() -> None:
    assert (
        limit_ceiling(versus_ideal(_batch(["a", "b", "c", "a"]), slots=2, limit=2), slots=2) == 1.0
    )
