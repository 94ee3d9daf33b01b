"""The ``hot-mixed`` scenario (issue 38): ``--hot-tasks`` (2,000) x ``--hot-duration`` (100 ms)
over ``--hot-keys`` (200) keys, one of them hot (``--hot-share``, 30% of the tasks), the others
drawn evenly; limit ``--hot-limit`` (3); one worker on the run's pool with
``--hot-concurrency`` (200) slots; all sent at once, in a seeded random order.

Measured against the ideal work-conserving FIFO dispatcher with the same slots, the limit and
the same send times (:mod:`benchmarks.celery_e2e.ideal`), each body taking its nominal
``--hot-duration`` (not the measured mean, as the mixed scenario takes: 200 bodies at once on a
busy host last longer than the hot key's that run later, and their mean would lengthen the
hot key's ideal chain): utilization = ideal makespan /
makespan (target >= 0.85), wait percentiles, over-admissions (target 0). A plain batch of the
same tasks on the same worker (the two in turns, ``--hot-rounds``) shows the pool's own pace:
it over-admits, and its utilization is taken against the ideal without the limit.
"""

from __future__ import annotations

import argparse
import random
import statistics

from benchmarks.celery_e2e.harness import Bench, pool_name, run_rounds
from benchmarks.celery_e2e.scenarios import print_mixed_table, scaled, versus_ideal
from benchmarks.celery_e2e.tables import Target, print_targets

UTILIZATION = 0.85


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hot-tasks", type=int, default=2000)
    group.add_argument("--hot-duration", type=float, default=0.1)
    group.add_argument("--hot-keys", type=int, default=200)
    group.add_argument("--hot-share", type=float, default=0.3, help="the hot key's share")
    group.add_argument("--hot-limit", type=int, default=3)
    group.add_argument("--hot-concurrency", type=int, default=200)
    group.add_argument("--hot-rounds", type=int, default=1, help="fair and plain batches")


def hot_keys(n: int, keys: int, share: float, seed: int) -> list[str]:
    """``n`` keys: ``hot`` with probability ``share``, else one of ``keys - 1`` others."""
    rng = random.Random(seed)
    return [
        "hot" if rng.random() < share else f"k{rng.randrange(max(1, keys - 1))}" for _ in range(n)
    ]


def hot_mixed(bench: Bench) -> bool:
    a = bench.args
    n, slots, limit = scaled(a.hot_tasks, a.scale), a.hot_concurrency, a.hot_limit
    keys = hot_keys(n, a.hot_keys, a.hot_share, a.seed)
    print(
        f"{n} tasks x {a.hot_duration * 1000:g} ms over {a.hot_keys} keys (hot key "
        f"{keys.count('hot')} tasks), limit {limit}, one worker -P {pool_name(a)} -c {slots}, "
        f"prefetch {a.prefetch}; {a.hot_rounds} round(s) of a fair and a plain batch"
    )
    by_mode = run_rounds(
        bench,
        ("fair", "plain"),
        keys,
        a.hot_duration,
        rounds=a.hot_rounds,
        workers=1,
        concurrency=slots,
        limit=limit,
    )
    d = a.hot_duration
    results = {m: [versus_ideal(b, slots, limit, d) for b in bs] for m, bs in by_mode.items()}
    print_mixed_table(results)
    fair = results["fair"]
    for plain in by_mode["plain"]:
        free = versus_ideal(plain, slots, n, d)
        print(
            f"{plain.tag}: utilization of the ideal without the limit "
            f"{free.utilization:.2f} (plain keeps no limit; its mean body {plain.body:.3f}s)"
        )
    for batch in by_mode["fair"]:
        hot = [r["end"] - r["start"] for r in batch.records if r["key"] == "hot"]
        chain = len(hot) * d / limit
        print(
            f"{batch.tag}: mean body {batch.body:.3f}s, the hot key's {sum(hot) / len(hot):.3f}s; "
            f"the hot key's chain alone: {len(hot)} x {d:g}s / {limit} = {chain:.2f}s"
        )
    median = statistics.median
    lags = [r.p99 - r.ideal_p99 for r in fair]
    print(
        f"fair p99 start delay {median(r.p99 for r in fair):.2f}s "
        f"(ideal {median(r.ideal_p99 for r in fair):.2f}s, {median(lags):+.2f}s)"
    )
    utilization = median(r.utilization for r in fair)
    return print_targets(
        [
            Target("fair utilization of the ideal", utilization, UTILIZATION),
            Target("over-admissions (fair)", sum(r.batch.over for r in fair), 0, True, 0),
        ]
    )
