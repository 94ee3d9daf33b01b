"""The benchmark dump report's arithmetic, on a hand-made batch whose answers are known."""

from __future__ import annotations

from typing import Any

from benchmarks.celery_e2e.dump_report import (
    behind_batch,
    behind_ideal,
    child_split,
    hand_overs,
    lost_while_startable,
    slot_time,
)


def _run(key: str, sent: float, start: float, end: float, pid: int, worker: str) -> dict[str, Any]:
    return {"key": key, "sent": sent, "start": start, "end": end, "pid": pid, "worker": worker}


# Limit 1 on key "a", three runs of 80 ms, all sent at 0: the second starts 30 ms after the
# first ends, on another worker; the third 2 ms after the second ends, in the same child. Key
# "b" runs once, in a second slot of the first worker.
RUNS = [
    _run("a", 0.0, 0.000, 0.080, 1, "w1"),
    _run("a", 0.0, 0.110, 0.190, 3, "w2"),
    _run("a", 0.0, 0.192, 0.272, 3, "w2"),
    _run("b", 0.0, 0.005, 0.085, 2, "w1"),
]


def test_slot_time_splits_idle_time_into_start_gaps_and_tail() -> None:
    line = slot_time(RUNS, 0.0)
    # Slots: (w1, 1) start 0, tail 192 ms; (w1, 2) start 5, tail 187; (w2, 3) start 110,
    # one gap of 2, tail 0. Means over the 3 slots: start 38.3, gaps 0.7, tail 126.3.
    assert line == (
        "slot time (ms per slot, 3 slots): start 38.3, gaps 0.7 (median gap 2.00), tail 126.3"
    )


def test_slot_time_lost_while_a_task_could_start_is_split_by_tenth_of_the_batch() -> None:
    # Two slots, limit 1. Lost: b could start in the free slot from 0 to 5 ms; a's second
    # run from a's first end (80 ms) to its start (110 ms), 5 ms of it while b ran and 25 ms
    # with both slots free (one task, one slot); a's third from 190 to 192 ms. In all 37 ms,
    # 18.5 per slot. Tenths of the 272 ms batch are 27.2 ms wide: 5 ms in the first,
    # 80-81.6 in the third, 81.6-108.8 in the fourth, 108.8-110 in the fifth, 190-190.4 in
    # the seventh and 190.4-192 in the eighth.
    line = lost_while_startable(RUNS, 0.0, slots=2, limit=1)
    assert line == (
        "lost while a task could start (ms per slot): 18.5; by tenth of the batch: "
        "2.5, 0.0, 0.8, 13.6, 0.6, 0.0, 0.2, 0.8, 0.0, 0.0"
    )


def test_nothing_is_lost_where_every_waiting_task_is_held_back_by_its_limit() -> None:
    # Limit 1, two slots, key "a" only: the second slot is free throughout, but only one
    # "a" may run; the hand-over gap of 10 ms is lost. A run over the limit (a plain batch's
    # over-admission) makes no room for more.
    runs = [
        _run("a", 0.0, 0.000, 0.050, 1, "w1"),
        _run("a", 0.0, 0.060, 0.110, 1, "w1"),
        _run("a", 0.0, 0.060, 0.110, 2, "w1"),
    ]
    assert lost_while_startable(runs, 0.0, slots=2, limit=1).startswith(
        "lost while a task could start (ms per slot): 5.0; "
    )


def test_a_batch_sent_before_its_workers_consumed_counts_from_when_they_did() -> None:
    # Sent at 0 while the workers did not consume; they started at 1.0 (the first send the
    # benchmark records), and the run started 4 ms later: 4 ms lost in one slot, not 1004.
    runs = [_run("a", 0.0, 1.004, 1.054, 1, "w1")]
    assert lost_while_startable(runs, 1.0, slots=1, limit=1).startswith(
        "lost while a task could start (ms per slot): 4.0; "
    )


def test_hand_overs_at_the_limit_are_told_apart_by_where_the_runs_were() -> None:
    line = hand_overs(RUNS, limit=1)
    assert line == (
        "hand-overs at the limit (ms): same child 1 (median 2.0, sum 2); "
        "other worker 1 (median 30.0, sum 30)"
    )


def test_a_run_that_found_a_permit_free_is_no_hand_over() -> None:
    assert hand_overs(RUNS, limit=2) == "hand-overs at the limit (ms): none"


def test_runs_behind_the_ideal_count_the_starts_the_ideal_made_earlier() -> None:
    dump = {
        "sent": [r["sent"] for r in RUNS],
        "keys": [r["key"] for r in RUNS],
        "records": RUNS,
    }
    # The ideal (2 slots, limit 1, bodies of 80 ms) starts a and b at 0, then a at 0.08 and
    # 0.16: by 0.1 s it started 3 runs (the real batch 2), by 0.2 s all 4 (so did the batch).
    line = behind_ideal(dump, slots=2, limit=1)
    assert line.startswith("runs behind the ideal: 0.1s +1, 0.2s +0, 0.3s +0, ")


def test_gaps_in_one_child_split_at_the_childs_stamps() -> None:
    # One child runs "a" then "b": a's body ends at 0.080, Celery ends a (task_postrun) at
    # 0.081, b begins (task_prerun) at 0.084 and its body at 0.085. A second child's
    # record names a previous run that is not in the batch: its gap is left out.
    first = {**_run("a", 0.0, 0.000, 0.080, 1, "w1"), "id": "t.1"}
    second = {
        **_run("b", 0.0, 0.085, 0.160, 1, "w1"),
        "id": "t.2",
        "prerun": 0.084,
        "prev": ["t.1", 0.081],
    }
    other = [
        {**_run("c", 0.0, 0.000, 0.080, 2, "w1"), "id": "t.3"},
        {
            **_run("c", 0.0, 0.090, 0.170, 2, "w1"),
            "id": "t.4",
            "prerun": 0.089,
            "prev": ["warm.1", 0.082],
        },
    ]
    line = child_split([first, second, *other])
    # After 1 ms, outside 3 ms, before 1 ms: per slot (2 slots) 0.5, 1.5 and 0.5.
    assert line == (
        "gaps in one child (ms per slot, 1 gaps): after the body 0.5 (median 1.00), "
        "outside the child 1.5 (median 3.00), before the next body 0.5 (median 1.00)"
    )


def test_records_without_stamps_give_no_split() -> None:
    assert child_split(RUNS) is None


def test_runs_behind_another_batch_count_from_each_batchs_first_send() -> None:
    # The other batch (sent from 10.0) started runs at +0.05, +0.15 and +0.25 s; this one
    # (sent from 0.0) at 0.05, 0.25 and 0.5: one behind at 0.2 s and 0.3 s, and from 0.6 s
    # on both started all three.
    this = {
        "sent": [0.0, 0.0, 0.0],
        "records": [_run("a", 0.0, t, t + 0.05, 1, "w1") for t in (0.05, 0.25, 0.5)],
    }
    other = {
        "sent": [10.0, 10.0, 10.0],
        "records": [_run("a", 10.0, 10.0 + t, 10.05 + t, 1, "w1") for t in (0.05, 0.15, 0.25)],
    }
    line = behind_batch(this, other)
    assert line == (
        "runs behind the other batch: 0.1s +0, 0.2s +1, 0.3s +1, 0.6s +0, 0.9s +0, 1.2s +0"
    )
    assert behind_batch(other, this) == (
        "runs behind the other batch: 0.1s +0, 0.2s -1, 0.3s -1, 0.6s +0, 0.9s +0, 1.2s +0"
    )
