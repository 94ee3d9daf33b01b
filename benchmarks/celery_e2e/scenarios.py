"""The named scenarios of issue 19: each measured side by side, on one broker, in one run.

Run through :mod:`benchmarks.celery_e2e` (``--scenario backlog,uncontended,mixed``); its
docstring says what each scenario measures and which targets it prints. Every phase gets fresh
workers (:func:`~benchmarks.celery_e2e.harness.run_batch`); a scenario prints its host line, a
table of its phases (:mod:`benchmarks.celery_e2e.tables`), then each target with its figure and
MET or MISSED.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.celery_e2e.harness import (
    Batch,
    Bench,
    pool_name,
    pool_slots,
    run_batch,
    run_rounds,
)
from benchmarks.celery_e2e.ideal import ideal_schedule, percentile
from benchmarks.celery_e2e.tables import (
    Target,
    deliveries,
    header,
    print_cpu,
    print_targets,
    rate,
    row,
)

BACKLOG_GUARDED = (1, 4)  # one worker -c 4 (on prefork; other pools: their concurrency)
BACKLOG_SPREAD = (2, 4)  # two workers -c 4 (idem)
UNCONTENDED_WORKERS = (1, 4)  # (idem)
PACE = {"prefork": 0.9}  # the backlog's pace target: issue 19's on prefork, issue 38's else
PACE_OTHER_POOLS = 0.85
UNCONTENDED_LIMIT = 2
IDEAL_P99_FLOOR = 0.001  # an ideal p99 below this makes p99 / ideal meaningless: n/a


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--backlog-tasks", type=int, default=1000, help="burst depth on one key")
    group.add_argument("--backlog-duration", type=float, default=0.02)
    group.add_argument(
        "--backlog-limit", type=int, default=2, help="also the baseline's -c (default 2)"
    )
    group.add_argument(
        "--others", type=int, default=20, help="tasks for other keys sent after the burst"
    )
    group.add_argument("--uncontended-tasks", type=int, default=600)
    group.add_argument("--uncontended-keys", type=int, default=300)
    group.add_argument("--uncontended-duration", type=float, default=0.01)
    group.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="uncontended and mixed: guarded and plain batches, in turns on the same workers "
        "(default 3)",
    )


def scaled(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def part(batch: Batch, keys: set[str], received: int | None = None) -> Batch:
    """The tasks of ``batch`` for ``keys`` (``received``: their delivery count, if known)."""
    sent = [s for s, k in zip(batch.sent, batch.keys, strict=True) if k in keys]
    return Batch(batch.tag, sent, [k for k in batch.keys if k in keys], batch.of(keys), 0, received)


# -- backlog --------------------------------------------------------------------------------------


def backlog(bench: Bench) -> bool:
    """One hot key's deep line, against the same tasks unguarded on a worker sized to the limit."""
    a = bench.args
    n, d, limit = scaled(a.backlog_tasks, a.scale), a.backlog_duration, a.backlog_limit
    pool, c = pool_name(a), pool_slots(a, BACKLOG_GUARDED[1])
    print(
        f"{n} tasks x {d * 1000:g} ms on one key, limit {limit}, -P {pool}, prefetch "
        f"{a.prefetch}; baseline: the same tasks unguarded on a dedicated worker "
        f"-P {pool} -c {limit}"
    )
    base = run_batch(
        bench, "plain", "baseline", ["b-hot"] * n, d, workers=1, concurrency=limit, limit=limit
    )
    phases = {"guarded": (BACKLOG_GUARDED[0], c), "spread": (BACKLOG_SPREAD[0], c)}
    runs = {"baseline": ((1, limit), base)}
    for tag, (workers, concurrency) in phases.items():
        keys = [f"{tag[0]}-hot"] * n
        runs[tag] = (
            (workers, concurrency),
            run_batch(
                bench, "fair", tag, keys, d, workers=workers, concurrency=concurrency, limit=limit
            ),
        )
    others = [f"other-{i}" for i in range(a.others)]
    workers, concurrency = phases["guarded"]
    hol = run_batch(
        bench,
        "fair",
        "hol",
        ["h-hot"] * n + others,
        d,
        workers=workers,
        concurrency=concurrency,
        limit=limit,
    )
    burst_received = None if hol.received is None else hol.received - len(others)
    runs["hol burst"] = ((workers, concurrency), part(hol, {"h-hot"}, burst_received))
    late = part(hol, set(others))

    columns = ["workers", "tasks", "makespan", "ideal", "pace", "vs ideal", "re-pub/task"]
    header("phase", [*columns, "deliv/task", "over"])
    for name, ((workers, concurrency), batch) in runs.items():
        ideal = len(batch.records) * batch.body / limit
        pace = base.makespan / batch.makespan
        extra = [f"{ideal:.2f}s", f"{pace:.2f}", f"{ideal / batch.makespan:.2f}"]
        print(row(name, f"{workers} x c{concurrency}", batch, extra))
    late_done = late.makespan
    waits = [r["start"] - r["sent"] for r in late.records]
    print(
        f"head-of-line: {len(others)} tasks x {d * 1000:g} ms for {len(others)} other keys, "
        f"sent after the {n}-deep burst: all done {late_done:.2f}s after the first was sent "
        f"(wait p50 {percentile(waits, 0.5):.2f}s, max {max(waits):.2f}s; "
        f"re-pub/task {late.retries / len(late.records):.3f})"
    )
    targets = []
    for tag in phases:
        batch = runs[tag][1]
        pace = PACE.get(pool, PACE_OTHER_POOLS)
        targets.append(Target(f"pace {tag}/baseline", base.makespan / batch.makespan, pace))
        targets.append(
            Target(f"re-publishes per task ({tag})", rate(batch.retries, batch), 0.1, True, 3)
        )
    over = sum(batch.over for _, batch in runs.values()) + hol.over
    targets.append(Target("over-admissions (all phases)", over, 0, True, 0))
    targets.append(Target(f"{len(others)} other keys' tasks done within (s)", late_done, 1.0, True))
    return print_targets(targets)


# -- uncontended ----------------------------------------------------------------------------------


def uncontended(bench: Bench) -> bool:
    """Tiny tasks over many keys (round robin: no key ever contended), guarded and plain in
    the same worker, batch after batch: the ratio is the median of the rounds' ratios."""
    a = bench.args
    n = scaled(a.uncontended_tasks, a.scale)
    k = min(n, scaled(a.uncontended_keys, a.scale))
    d, workers = a.uncontended_duration, UNCONTENDED_WORKERS[0]
    concurrency = pool_slots(a, UNCONTENDED_WORKERS[1])
    keys = [f"u{i % k}" for i in range(n)]
    print(
        f"{n} tasks x {d * 1000:g} ms over {k} keys (round robin), limit {UNCONTENDED_LIMIT}, "
        f"{workers} worker -P {pool_name(a)} -c {concurrency}, prefetch {a.prefetch}; "
        f"{a.rounds} rounds of a "
        "guarded and a plain batch on the same worker, in turns"
    )
    batches = run_rounds(
        bench,
        ("fair", "plain"),
        keys,
        d,
        rounds=a.rounds,
        workers=workers,
        concurrency=concurrency,
        limit=UNCONTENDED_LIMIT,
    )
    header(
        "batch", ["workers", "tasks", "makespan", "tasks/s", "re-pub/task", "deliv/task", "over"]
    )
    ratios = []
    for r, (fair, plain) in enumerate(zip(batches["fair"], batches["plain"], strict=True)):
        for batch in (fair, plain) if r % 2 == 0 else (plain, fair):
            extra = [f"{n / batch.makespan:.1f}"]
            print(row(batch.tag, f"{workers} x c{concurrency}", batch, extra))
        ratios.append(plain.makespan / fair.makespan)
    print("round ratios guarded/plain: " + ", ".join(f"{x:.2f}" for x in ratios))
    print_cpu(batches["fair"], batches["plain"])
    return print_targets(
        [
            Target("throughput guarded/plain (median round)", statistics.median(ratios), 0.95),
            Target("over-admissions", sum(b.over for b in batches["fair"]), 0, True, 0),
        ]
    )


# -- mixed (and the classic run) ------------------------------------------------------------------


@dataclass
class Versus:
    """A mode's run against the ideal FIFO dispatcher for the same send times."""

    batch: Batch
    ideal_makespan: float
    p50: float
    p99: float
    ideal_p50: float
    ideal_p99: float

    @property
    def utilization(self) -> float:
        return self.ideal_makespan / self.batch.makespan

    @property
    def p99_ratio(self) -> float | None:
        return None if self.ideal_p99 < IDEAL_P99_FLOOR else self.p99 / self.ideal_p99


def _sent_from_first(batch: Batch) -> list[float]:
    """``batch``'s send times, in seconds after its first send."""
    t0 = min(batch.sent)
    return [s - t0 for s in batch.sent]


def versus_ideal(batch: Batch, slots: int, limit: int, duration: float | None = None) -> Versus:
    """``batch`` against the ideal FIFO dispatcher whose bodies take ``duration`` each
    (default: the batch's measured mean body)."""
    body = batch.body if duration is None else duration
    waits = [r["start"] - r["sent"] for r in batch.records]
    sent = _sent_from_first(batch)
    ideal_start = ideal_schedule(sent, batch.keys, slots, limit, body)
    ideal_waits = [start - s for start, s in zip(ideal_start, sent, strict=True)]
    return Versus(
        batch=batch,
        ideal_makespan=max(ideal_start) + body,
        p50=percentile(waits, 0.5),
        p99=percentile(waits, 0.99),
        ideal_p50=percentile(ideal_waits, 0.5),
        ideal_p99=percentile(ideal_waits, 0.99),
    )


def mixed(bench: Bench) -> bool:
    """Today's default run: short tasks over a few keys. As the named scenario (modes fair
    and plain), ``--rounds`` batches of each in turns on the same workers, each figure the
    median of the rounds'; the classic run gives every mode fresh workers of its own."""
    a = bench.args
    concurrency = pool_slots(a, a.concurrency)
    n, slots = scaled(a.tasks, a.scale), a.workers * concurrency
    rng = random.Random(a.seed)
    keys = [f"k{rng.randrange(a.keys)}" for _ in range(n)]
    rounds = a.rounds if a.scenario and sorted(a.modes) == ["fair", "plain"] else 1
    print(
        f"{n} tasks x {a.duration * 1000:g} ms, {a.keys} keys, limit {a.limit}, "
        f"{a.workers} workers -P {pool_name(a)} x {concurrency} slots ({slots}), "
        f"prefetch {a.prefetch}"
        + (
            f"; {rounds} rounds of a fair and a plain batch on the same workers"
            if rounds > 1
            else ""
        )
    )
    shape = {"workers": a.workers, "concurrency": concurrency, "limit": a.limit}
    if rounds > 1:
        by_mode = run_rounds(bench, ("fair", "plain"), keys, a.duration, rounds=rounds, **shape)
    else:
        by_mode = {m: [run_batch(bench, m, m, keys, a.duration, **shape)] for m in a.modes}
    # Off prefork, 100-200 bodies at once on a few CPUs last far longer than their nominal
    # time (plain's mean body reached 1 s for 50 ms on gevent): the ideal takes the nominal.
    nominal = None if pool_name(a) == "prefork" else a.duration
    results = {
        m: [versus_ideal(b, slots, a.limit, nominal) for b in bs] for m, bs in by_mode.items()
    }
    print_mixed_table(results)
    fair = results.get("fair")
    if fair is None:
        return True
    median = statistics.median
    targets = [Target("fair utilization", median(r.utilization for r in fair), 0.9)]
    if "plain" in results:
        ratios = [
            f.utilization / p.utilization for f, p in zip(fair, results["plain"], strict=True)
        ]
        if rounds > 1:
            print("round ratios fair/plain utilization: " + ", ".join(f"{x:.2f}" for x in ratios))
        print_cpu(by_mode["fair"], by_mode["plain"])
        ceiling = median(limit_ceiling(r, slots, nominal) for r in fair)
        print(
            f"the limit's own cost: the ideal without it is {ceiling:.3f} of the ideal with "
            f"it, so keeping the limit reaches at most {ceiling:.2f} of plain's utilization "
            f"(plain over-admits)"
        )
        if pool_name(a) == "prefork":
            targets.append(Target("fair utilization / plain's", median(ratios), 0.95))
        else:  # many slots: plain runs nearly all at once, far past what the limit allows
            name = "fair utilization / plain's, over the ceiling"
            targets.append(Target(name, median(ratios) / ceiling, 0.95))
    p99s = [r.p99_ratio for r in fair]
    p99 = None if None in p99s else median(x for x in p99s if x is not None)
    targets.append(Target("fair p99 wait / ideal p99", p99, 1.5, True))
    targets.append(Target("over-admissions (fair)", sum(r.batch.over for r in fair), 0, True, 0))
    if rounds > 1:
        print("(figures: the median of the rounds')")
    return print_targets(targets)


def limit_ceiling(versus: Versus, slots: int, duration: float | None = None) -> float:
    """The ideal FIFO makespan without the limit over the one with it (``versus``'s), for the
    same send times: the most of plain's utilization a dispatcher that keeps the limit can
    reach where plain (which over-admits) runs at the ideal without it."""
    batch = versus.batch
    body = batch.body if duration is None else duration
    free = ideal_schedule(_sent_from_first(batch), batch.keys, slots, len(batch.sent), body)
    return (max(free) + body) / versus.ideal_makespan


def print_mixed_table(results: dict[str, list[Versus]]) -> None:
    columns = ["makespan", "ideal", "util", "p50 wait", "p99 wait", "ideal p50", "ideal p99"]
    columns += ["p99/ideal", "over", "re-pub/task", "deliv/task"]
    line = f"{'batch':<8}" + "".join(f"{c:>12}" for c in columns)
    print(line)
    print("-" * len(line))
    for mode, runs in results.items():
        for r in runs:
            b = r.batch
            cells = [f"{b.makespan:.2f}s", f"{r.ideal_makespan:.2f}s", f"{r.utilization:.2f}"]
            cells += [f"{v:.3f}s" for v in (r.p50, r.p99, r.ideal_p50, r.ideal_p99)]
            cells += ["n/a" if r.p99_ratio is None else f"{r.p99_ratio:.2f}", str(b.over)]
            cells += [f"{rate(b.retries, b):.3f}", deliveries(b)]
            print(f"{b.tag if len(runs) > 1 else mode:<8}" + "".join(f"{c:>12}" for c in cells))


SCENARIOS: dict[str, Callable[[Bench], bool]] = {
    "backlog": backlog,
    "uncontended": uncontended,
    "mixed": mixed,
}
