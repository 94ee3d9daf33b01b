"""The stop scenarios' ledger: each task's category from its runs, on runs whose answer is
known (no worker, no server: the arithmetic of benchmarks.celery_e2e.ledger)."""

from __future__ import annotations

from benchmarks.celery_e2e.ledger import (
    Run,
    build_ledger,
    classify,
    is_defect,
    most_at_once,
    overlapping,
)

STOP = 100.0
KILL = {"killed": True, "acks_late": True}
TERM = {"killed": False, "acks_late": False}


def test_one_run_that_ended_is_once() -> None:
    assert classify([Run(1.0, 1.02)], STOP, **KILL) == "once"
    assert classify([Run(1.0, 1.02)], None, **TERM) == "once"


def test_a_body_cut_by_the_kill_and_run_again_is_expected_under_acks_late() -> None:
    runs = [Run(120.0, 120.02), Run(99.99)]  # (any order)
    assert classify(runs, STOP, **KILL) == "rerun after cut"
    assert not is_defect("rerun after cut", **KILL)


def test_a_body_that_ended_just_before_the_kill_may_run_again() -> None:
    runs = [Run(99.3, 99.32), Run(130.0, 130.02)]
    assert classify(runs, STOP, **KILL) == "ack in flight"
    assert not is_defect("ack in flight", **KILL)


def test_a_double_of_a_task_that_ended_well_before_the_kill_is_a_defect() -> None:
    runs = [Run(90.0, 90.02), Run(130.0, 130.02)]
    assert classify(runs, STOP, **KILL) == "ran twice"
    assert is_defect("ran twice", **KILL)


def test_no_ack_window_after_a_sigterm() -> None:
    runs = [Run(99.8, 99.82), Run(130.0, 130.02)]
    assert classify(runs, STOP, **TERM) == "ran twice"


def test_never_ran_is_lost_unless_a_failure_was_recorded() -> None:
    assert classify([], STOP, **KILL) == "lost"
    assert is_defect("lost", **KILL)
    assert classify([], STOP, failed=True, **KILL) == "failed"
    assert not is_defect("failed", **KILL)


def test_a_cut_body_not_run_again_is_lost_except_a_sigkill_without_acks_late() -> None:
    assert classify([Run(99.9)], STOP, **KILL) == "cut, not run again"
    assert is_defect("cut, not run again", killed=True, acks_late=True)
    assert is_defect("cut, not run again", killed=False, acks_late=False)
    assert not is_defect("cut, not run again", killed=True, acks_late=False)


def test_a_run_begun_after_the_stop_that_never_ended_is_unfinished() -> None:
    assert classify([Run(101.0)], STOP, **KILL) == "unfinished"


def test_copies_at_once_and_the_most_bodies_at_once() -> None:
    assert overlapping([Run(1.0, 2.0), Run(1.5, 2.5)], None)
    assert not overlapping([Run(1.0, 2.0), Run(2.0, 2.5)], None)
    # a cut body lasts until the stop
    assert overlapping([Run(99.0), Run(99.5, 99.6)], STOP)
    runs = [Run(0.0, 1.0), Run(0.5, 1.5), Run(1.0, 2.0), Run(99.0)]
    assert most_at_once(runs, STOP) == 2  # an end before a start at the same moment


def test_the_ledger_matches_each_end_to_its_start() -> None:
    ids = ["t.0", "t.1", "t.2", "t.3", "t.4"]
    starts = [
        {"id": "t.0", "start": 10.0},
        {"id": "t.1", "start": 99.5},
        {"id": "t.1", "start": 120.0},
        {"id": "t.2", "start": 99.95},
        {"id": "t.2", "start": 121.0},
        {"id": "t.4", "start": 50.0},
        {"id": "t.4", "start": 122.0},
    ]
    ends = [
        {"id": "t.0", "start": 10.0, "end": 10.02},
        {"id": "t.1", "start": 99.5, "end": 99.52},
        {"id": "t.1", "start": 120.0, "end": 120.02},
        {"id": "t.2", "start": 121.0, "end": 121.02},
        {"id": "t.4", "start": 50.0, "end": 50.02},
        {"id": "t.4", "start": 122.0, "end": 122.02},
    ]
    ledger = build_ledger(ids, starts, ends, STOP, **KILL)
    assert ledger.categories == {
        "t.0": "once",
        "t.1": "ack in flight",
        "t.2": "rerun after cut",
        "t.3": "lost",
        "t.4": "ran twice",
    }
    assert ledger.defects == 2
    assert [round(g, 2) for g in ledger.ack_gaps] == [0.48]
    assert ledger.line() == "once 1, rerun after cut 1, ack in flight 1, ran twice 1, lost 1"
