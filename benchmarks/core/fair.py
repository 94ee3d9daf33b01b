"""Fair share benchmark: the cost of a grant with 10,000 groups waiting against one group.

Run with ``python -m benchmarks.core.fair`` (same server rules as ``python -m benchmarks.core``:
``$REDSEM_BENCH_REDIS_URL`` or a private embedded Valkey; keys under a unique prefix, deleted by
SCAN at the end). Target (issue 40): acquire+release with 10,000 groups waiting at >= 0.8 x the
same pair with one group.

Each setup is a grouped semaphore of limit 1 with ``--waiters`` places in line (default 10,000),
spread over that many groups or all in one group. One **cycle** is what a busy fair line does
per grant: the holder releases (``fair_release.lua``, which wakes the next head), joins its
group's line again (an attempt that is not granted), and the head of the line attempts and is
granted: three script calls, one client. The setups take turns in batches of ``BATCH`` cycles,
in a new random order every turn, so background load hits them alike; a round's rate is cycles
over the time spent in its own batches, and the figures are medians over rounds. Two reference
lines are measured in the same turns: a plain (ungrouped, FIFO) semaphore of limit 1 with the
same number of waiters doing the same cycle, and an idle pair (acquire + release, nobody
waiting) with a group and without one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence

import redis

from benchmarks._brokers import cpu_model
from benchmarks._server import bench_server, delete_prefix, unique_prefix
from celery_redsem import FairSemaphore, Permit

BATCH = 20
TARGET = 0.8
LONG = 3600.0  # leases long enough that nothing expires during a run


class Line:
    """A semaphore of limit 1 with a full line, cycled grant by grant (see the module doc)."""

    def __init__(self, sem: FairSemaphore, places: Sequence[tuple[str, str | None]]) -> None:
        self.sem = sem
        self.order: deque[tuple[str, str | None]] = deque()
        first_pid, first_group = places[0]
        held = sem.attempt(first_pid, group=first_group)
        if not isinstance(held, Permit):
            raise RuntimeError(f"{sem!r}: the first caller got no permit")
        self.held, self.held_group = held, first_group
        for pid, group in places[1:]:
            if isinstance(sem.attempt(pid, join_line=True, group=group), Permit):
                raise RuntimeError(f"{sem!r}: {pid} was granted past the limit")
            self.order.append((pid, group))

    def cycle(self) -> None:
        sem = self.sem
        sem.release(self.held)
        back = (self.held.id, self.held_group)
        if isinstance(sem.attempt(back[0], join_line=True, group=back[1]), Permit):
            raise RuntimeError("a caller that came back was granted before the head")
        self.order.append(back)
        pid, group = self.order.popleft()
        granted = sem.attempt(pid, join_line=True, group=group)
        if not isinstance(granted, Permit):
            raise RuntimeError(f"the head {pid} of group {group} was not granted: {granted}")
        self.held, self.held_group = granted, group


class IdlePair:
    """Acquire + release on a semaphore nobody waits for, with or without a group."""

    def __init__(self, sem: FairSemaphore, group: str | None) -> None:
        self.sem, self.group = sem, group

    def cycle(self) -> None:
        permit = self.sem.attempt(group=self.group)
        if not isinstance(permit, Permit):
            raise RuntimeError(f"{self.sem!r} refused a permit while idle")
        self.sem.release(permit)


def build(client: redis.Redis, prefix: str, waiters: int) -> dict[str, Callable[[], None]]:
    """The setups, by name, each ready to cycle."""

    def sem(name: str, grouped: bool) -> FairSemaphore:
        return FairSemaphore(
            client, name, 1, prefix=prefix, grouped=grouped, lease=LONG, waiter_lease=LONG
        )

    width = len(str(waiters))
    many = [(f"p{i:0{width}}", f"g{i:0{width}}") for i in range(waiters + 1)]
    one = [(f"p{i:0{width}}", "g") for i in range(waiters + 1)]
    fifo = [(f"p{i:0{width}}", None) for i in range(waiters + 1)]
    return {
        f"{waiters} groups": Line(sem("many", True), many).cycle,
        "1 group": Line(sem("one", True), one).cycle,
        "FIFO, no group": Line(sem("fifo", False), fifo).cycle,
        "idle, a group": IdlePair(sem("idle-g", True), "g").cycle,
        "idle, no group": IdlePair(sem("idle", False), None).cycle,
    }


def run(
    setups: dict[str, Callable[[], None]], rounds: int, slice_s: float
) -> dict[str, list[float]]:
    """Cycles per second of every setup in every round, the setups taking turns in batches."""
    shuffle = random.Random(0)
    rates: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(rounds):
        spent = dict.fromkeys(setups, 0.0)
        done = dict.fromkeys(setups, 0)
        while min(spent.values()) < slice_s:
            names = list(setups)
            shuffle.shuffle(names)
            for name in names:
                cycle = setups[name]
                start = time.perf_counter()
                for _ in range(BATCH):
                    cycle()
                spent[name] += time.perf_counter() - start
                done[name] += BATCH
        for name in setups:
            rates[name].append(done[name] / spent[name])
    return rates


def ratio(rates: dict[str, list[float]], key: str, base: str) -> tuple[float, float, float]:
    """Median, lowest and highest per-round ratio of ``key`` to ``base``."""
    ratios = [a / b for a, b in zip(rates[key], rates[base], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table; exit status 0 even if the target is missed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.core.fair", description=__doc__)
    parser.add_argument("--waiters", type=int, default=10_000, help="places in line (10000)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (9)")
    parser.add_argument("--slice", type=float, default=0.3, help="seconds per setup a round")
    args = parser.parse_args(argv)
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    prefix = unique_prefix()
    with bench_server() as server:
        client = redis.Redis.from_url(server.url)
        print(
            f"host: nproc {nproc}, {cpu_model()}; {server.version}; python "
            f"{sys.version.split()[0]}, redis-py {redis.__version__}; key prefix {prefix}"
        )
        try:
            started = time.monotonic()
            setups = build(client, prefix, args.waiters)
            print(f"set up {args.waiters} waiters x 3 lines in {time.monotonic() - started:.1f}s")
            rates = run(setups, args.rounds, args.slice)
        finally:
            deleted = delete_prefix(client, prefix)
            client.close()
    print(f"\n{args.rounds} interleaved rounds of {args.slice}s per setup, medians:")
    print(f"{'setup':<22} {'cycles/s':>10}")
    for name, values in rates.items():
        print(f"{name:<22} {statistics.median(values):>10.0f}")
    many = f"{args.waiters} groups"
    med, lo, hi = ratio(rates, many, "1 group")
    verdict = "met" if med >= TARGET else "MISSED"
    print(
        f"\n{many} / 1 group: {med:.2f} x (rounds {lo:.2f}..{hi:.2f}); "
        f"target >= {TARGET}: {verdict}"
    )
    med, lo, hi = ratio(rates, "1 group", "FIFO, no group")
    print(
        f"1 group / FIFO with no group (same line length): {med:.2f} x (rounds {lo:.2f}..{hi:.2f})"
    )
    med, lo, hi = ratio(rates, "idle, a group", "idle, no group")
    print(f"idle pair with a group / without: {med:.2f} x (rounds {lo:.2f}..{hi:.2f})")
    print(f"Deleted {deleted} keys under {prefix}:*.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
