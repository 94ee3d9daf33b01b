"""Where a Celery benchmark batch lost time: read the files ``celery_e2e --dump`` wrote.

``python -m benchmarks.celery_e2e.dump_report PATH.redis.fair-0.json [PATH.redis.plain-0.json
...]`` prints, for each batch:

* **slot time**: per pool slot (a pool child), the mean idle time before its first run
  (``start``), between its runs (``gaps``, with the median gap) and after its last run until the
  batch's end (``tail``): what the makespan is made of beyond the bodies;
* **behind the ideal**: how many fewer runs had started by each moment than under the ideal
  work-conserving FIFO dispatcher the benchmark compares with (same send times, the limit,
  the measured mean body time): where in the batch the lag builds up;
* **between two runs in one child** (dumps whose records carry the child's stamps): the
  gaps split into the time in the child after a body (up to Celery's ``task_postrun``: for a
  guarded task, the release), outside the child (its result reaching the worker's main
  process, which frees the slot and sends the next task, and that task reaching the child),
  and in the child before the next body (from ``task_prerun``: for a guarded task, taking the
  grant over, or waiting for the permit there);
* **behind the other batch** (with ``--against OTHER``): how many fewer runs had started by
  each moment than in ``OTHER``, a batch of the same tasks run otherwise (the ``plain`` batch
  of the same round): when the lag between the two builds up, and whether it keeps growing;
* **lost while a task could start**: slot time in which a slot was free while a task sent
  and not started could have started there without going over its key's limit (what a
  work-conserving dispatcher never loses), per slot, and by tenth of the batch: the tenths
  show whether it is spread thin or lost in bursts (a batch whose runs end together frees
  many slots at once, and refilling them is what takes the time);
* **hand-overs at the limit**: for each run that started as soon as another run of its key
  freed a permit at the limit, the time from that run's end to this start, by where the two
  ran: the same pool child, another child of the same worker, or another worker (for guarded
  batches; in a plain batch nothing waits for a permit, and these are coincidences).

``--slots`` and ``--limit`` describe the run (default: the ``mixed`` scenario's 16 and 3).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter, defaultdict
from typing import Any

from benchmarks.celery_e2e.ideal import ideal_schedule

Record = dict[str, Any]

#: Moments (seconds after the first send) at which the lag behind the ideal is reported.
LAG_AT = (0.1, 0.2, 0.3, 0.6, 0.9, 1.2)


def runs_by_slot(records: list[Record]) -> list[list[Record]]:
    """The runs of each pool slot (a worker's child), in the order they started."""
    by_slot: dict[Any, list[Record]] = defaultdict(list)
    for r in records:
        by_slot[(r.get("worker"), r["pid"])].append(r)
    return [sorted(runs, key=lambda r: r["start"]) for runs in by_slot.values()]


def slot_time(records: list[Record], first_sent: float) -> str:
    """Mean idle milliseconds per pool slot before, between and after its runs."""
    end = max(r["end"] for r in records)
    slots = runs_by_slot(records)
    start = tail = 0.0
    gaps: list[float] = []
    for runs in slots:
        start += runs[0]["start"] - first_sent
        tail += end - runs[-1]["end"]
        gaps += [b["start"] - a["end"] for a, b in itertools.pairwise(runs)]
    n = len(slots)
    median = statistics.median(gaps) if gaps else 0.0
    return (
        f"slot time (ms per slot, {n} slots): start {start / n * 1000:.1f}, gaps "
        f"{sum(gaps) / n * 1000:.1f} (median gap {median * 1000:.2f}), tail {tail / n * 1000:.1f}"
    )


def child_split(records: list[Record]) -> str | None:
    """Milliseconds per slot (and medians) of the gaps in one child: after the body, outside
    the child, before the next body; None when the records carry no stamps."""
    slots = runs_by_slot(records)
    parts: dict[str, list[float]] = {"after": [], "outside": [], "before": []}
    for runs in slots:
        for a, b in itertools.pairwise(runs):
            prev = b.get("prev")
            if "prerun" not in b or not prev or prev[0] != a.get("id"):
                continue
            postrun = prev[1]
            parts["after"].append(postrun - a["end"])
            parts["outside"].append(b["prerun"] - postrun)
            parts["before"].append(b["start"] - b["prerun"])
    if not parts["after"]:
        return None
    n = len(slots)
    cells = [
        f"{name} {sum(xs) / n * 1000:.1f} (median {statistics.median(xs) * 1000:.2f})"
        for name, xs in (
            ("after the body", parts["after"]),
            ("outside the child", parts["outside"]),
            ("before the next body", parts["before"]),
        )
    ]
    return f"gaps in one child (ms per slot, {len(parts['after'])} gaps): " + ", ".join(cells)


def started_by(dump: dict[str, Any]) -> list[int]:
    """How many of ``dump``'s runs had started by each of :data:`LAG_AT` after its first send."""
    first = min(dump["sent"])
    starts = [r["start"] - first for r in dump["records"]]
    return [sum(1 for s in starts if s <= at) for at in LAG_AT]


def behind_ideal(dump: dict[str, Any], slots: int, limit: int) -> str:
    """Runs started by each of :data:`LAG_AT` under the ideal, minus those that started."""
    sent, keys, records = dump["sent"], dump["keys"], dump["records"]
    first = min(sent)
    body = statistics.fmean(r["end"] - r["start"] for r in records)
    ideal = ideal_schedule([s - first for s in sent], keys, slots, limit, body)
    cells = [
        f"{at:.1f}s {sum(1 for s in ideal if s <= at) - started:+d}"
        for at, started in zip(LAG_AT, started_by(dump), strict=True)
    ]
    return "runs behind the ideal: " + ", ".join(cells)


def behind_batch(dump: dict[str, Any], other: dict[str, Any]) -> str:
    """Runs ``other`` (a batch of the same tasks, such as the plain one of the same round) had
    started by each of :data:`LAG_AT` after its first send, minus those ``dump``'s had."""
    cells = [
        f"{at:.1f}s {theirs - ours:+d}"
        for at, ours, theirs in zip(LAG_AT, started_by(dump), started_by(other), strict=True)
    ]
    return "runs behind the other batch: " + ", ".join(cells)


def lost_while_startable(records: list[Record], first_sent: float, slots: int, limit: int) -> str:
    """Slot time (ms per slot) in which a slot was free and a sent task could have started in
    it within its key's limit, in all and by tenth of the batch from ``first_sent`` (the
    batch's first send; a batch sent before its workers consumed counts from when they did)."""
    first, end = first_sent, max(r["end"] for r in records)
    records = [{**r, "sent": max(r["sent"], first)} for r in records]
    moments = sorted({first, *(t for r in records for t in (r["sent"], r["start"], r["end"]))})
    tenths = [0.0] * 10
    width = (end - first) / 10
    for a, b in itertools.pairwise(moments):
        lost = _startable(records, slots, limit, (a + b) / 2)
        if not lost:
            continue
        for i in range(10):  # the share of [a, b) in each tenth
            lo, hi = first + i * width, first + (i + 1) * width
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                tenths[i] += lost * overlap
    per_slot = [t / slots * 1000 for t in tenths]
    return (
        f"lost while a task could start (ms per slot): {sum(per_slot):.1f}; by tenth of the "
        "batch: " + ", ".join(f"{t:.1f}" for t in per_slot)
    )


def _startable(records: list[Record], slots: int, limit: int, at: float) -> int:
    """How many free slots a task could have started in at ``at``: the free slots, at most
    the tasks sent and not started there whose keys were under their limit."""
    live: Counter[str] = Counter(r["key"] for r in records if r["start"] <= at < r["end"])
    queued: Counter[str] = Counter(r["key"] for r in records if r["sent"] <= at < r["start"])
    startable = sum(min(max(limit - live[key], 0), n) for key, n in queued.items())
    return max(min(slots - live.total(), startable), 0)


def hand_overs(records: list[Record], limit: int) -> str:
    """Milliseconds from a run's end to the start of the next run of its key it made room for."""
    by_place: dict[str, list[float]] = defaultdict(list)
    by_key: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_key[r["key"]].append(r)
    for runs in by_key.values():
        for r in runs:
            ended = [p for p in runs if p["end"] <= r["start"]]
            if not ended:
                continue
            freed = max(ended, key=lambda p: p["end"])  # the last run of its key to end first
            live = sum(1 for p in runs if p["start"] < r["start"] < p["end"])
            at_limit = sum(1 for p in runs if p["start"] < freed["end"] <= p["end"])
            if r["sent"] >= freed["end"] or live != limit - 1 or at_limit < limit:
                continue  # not waiting then, or not for the permit that run freed
            by_place[_place(freed, r)].append(r["start"] - freed["end"])
    cells = []
    for place in ("same child", "same worker", "other worker"):
        waits = by_place.get(place, [])
        if waits:
            cells.append(
                f"{place} {len(waits)} (median {statistics.median(waits) * 1000:.1f}, "
                f"sum {sum(waits) * 1000:.0f})"
            )
    return "hand-overs at the limit (ms): " + ("; ".join(cells) or "none")


def _place(freed: Record, started: Record) -> str:
    if freed.get("worker") != started.get("worker"):
        return "other worker"
    return "same child" if freed["pid"] == started["pid"] else "same worker"


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


def report(path: str, slots: int, limit: int, other: dict[str, Any] | None = None) -> None:
    """Print ``path``'s report (with ``other``, a dump of the same tasks to compare starts)."""
    dump = _load(path)
    records = dump["records"]
    first = min(dump["sent"])
    makespan = max(r["end"] for r in records) - first
    print(f"{path}: {len(records)} runs, makespan {makespan:.3f}s")
    for line in (
        slot_time(records, first),
        child_split(records),
        behind_ideal(dump, slots, limit),
        lost_while_startable(records, first, slots, limit),
        hand_overs(records, limit),
        behind_batch(dump, other) if other is not None else None,
    ):
        if line is not None:
            print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files celery_e2e --dump wrote")
    parser.add_argument("--slots", type=int, default=16, help="pool slots in all (default 16)")
    parser.add_argument("--limit", type=int, default=3, help="the per-key limit (default 3)")
    parser.add_argument(
        "--against",
        metavar="OTHER",
        help="a dump of the same tasks run otherwise (the plain batch of the same round): how "
        "many runs each batch is behind it, over time",
    )
    args = parser.parse_args()
    other = _load(args.against) if args.against else None
    for path in args.paths:
        report(path, args.slots, args.limit, other)


if __name__ == "__main__":
    main()
