"""Core benchmark: acquire+release cost on an idle semaphore, and correctness under contention.

Run with ``make bench-core`` (``python -m benchmarks.core``). Everything runs against one
server: ``$REDSEM_BENCH_REDIS_URL`` if set, else a private embedded Valkey. Keys live under a
unique prefix and are deleted by SCAN at the end; no database is ever flushed.

What is measured
----------------
**Idle throughput** (one client, one process): acquire+release pairs per second for

* ``floor``: two ``EVALSHA`` calls of ``return 1`` through the client (the issue's floor);
* the same two calls over one kept connection (a single-connection client): the transport
  FairSemaphore's acquire and release use (``celery_redsem/lane.py``), which spares the
  client's pool checkout on every call. FairSemaphore is measured against both;
* ``FairSemaphore``: celery_redsem, limit 5 (one script call to acquire, one to release);
* ``redis-py Lock``: ``redis.lock.Lock`` (``SET NX PX`` to acquire, a script to release);
* the three "Redis in Action" semaphores of :mod:`benchmarks.core.seed_semaphores`.

The implementations take turns in batches of 10 pairs, in a new random order every turn, so
background load (this may be a shared machine) and whatever ran just before hit them all
alike. A round lasts ``--slice`` seconds per implementation; an implementation's rate in a
round is its pairs over the time spent in its own batches. ``pairs/s`` is the median over
rounds; ``x floor`` and ``x redis Lock`` are medians of the per-round ratios. Targets:
FairSemaphore >= 0.85 x floor, and > 1.0 x redis Lock. The ratio to the kept-connection floor
is printed beside them: it is what the scripts cost over two bare round trips on the same
transport.

**Contention** (8 processes, limit 3, half of them with ``time.time`` running 20 ms ahead):
each process loops acquire, hold ~1 ms, release, for a fixed time. Right after an acquire it
runs INCR on a counter key that no implementation touches, and DECR right before the release,
so the counter never exceeds the number of real holders; every INCR reply above the limit is
an **over-admission**. ``skewed share`` is the fraction of all grants that went to the processes
with the fast clock (0.5 is fair). redis-py's Lock runs with limit 1 (it is a lock).
``FairSemaphore`` appears twice: waiting in its FIFO line (``acquire(blocking=True)``), and
with the same try + random sub-millisecond backoff loop the seed semaphores use.

**Worst refresh call** (:mod:`benchmarks.core.refresh_stall`; ``--refresh-permits``, default
10,000): the server time of the longest single refresh script call (from ``SLOWLOG``) when one
process refreshes that many permits at once, all in one call (as before chunking) and chunked.

If FairSemaphore misses the target against either floor, a breakdown follows: both floors,
FairSemaphore's own commands (recorded) replayed over a kept connection with trivial scripts in
place of the real ones (the cost of its keys and arguments), and FairSemaphore itself; each with
wall time, the server's script time (``INFO commandstats``) and this process's CPU time per
pair. ``--breakdown always`` forces it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import redis

from benchmarks._server import bench_server, delete_prefix, unique_prefix
from benchmarks.core.breakdown import run_breakdown
from benchmarks.core.contenders import IMPLS
from benchmarks.core.contention import CONTENDED_LIMIT, ContentionResult, run_contention
from benchmarks.core.idle import run_idle
from benchmarks.core.refresh_stall import print_stall, run_refresh_stall
from benchmarks.core.table import report

FLOOR_TARGET = 0.85


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line options (defaults keep a run well under 90 s on two cores)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--rounds", type=int, default=15, help="interleaved idle rounds (default 15)"
    )
    parser.add_argument(
        "--slice", type=float, default=0.2, help="seconds per idle slice (default 0.2)"
    )
    parser.add_argument("--procs", type=int, default=8, help="contending processes (default 8)")
    parser.add_argument(
        "--skew-ms", type=float, default=20.0, help="clock skew of half the processes"
    )
    parser.add_argument("--hold-ms", type=float, default=1.0, help="how long a permit is held")
    parser.add_argument(
        "--contention-seconds", type=float, default=3.0, help="length of each contention run"
    )
    parser.add_argument(
        "--breakdown",
        choices=["auto", "always", "never"],
        default="auto",
        help="print where FairSemaphore's time goes (auto: if it misses a floor target)",
    )
    parser.add_argument("--no-contention", action="store_true", help="idle throughput only")
    parser.add_argument(
        "--refresh-permits",
        type=int,
        default=10_000,
        help="permits refreshed at once for the worst refresh call (0: skip; default 10000)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; exit status 0 even when a target is missed (this is not a test)."""
    args = parse_args(argv)
    started = time.monotonic()
    prefix = unique_prefix()
    with bench_server() as server:
        client = redis.Redis.from_url(server.url)
        where = (
            "embedded, started for this run" if server.embedded else "from $REDSEM_BENCH_REDIS_URL"
        )
        print(f"celery_redsem core benchmark: {server.version} ({where}), key prefix {prefix}")
        print(
            f"python {sys.version.split()[0]}, redis-py {redis.__version__}, {os.cpu_count()} CPUs"
        )
        try:
            idle_keys = [impl.key for impl in IMPLS if impl.idle_key is None]
            idle = run_idle(client, prefix, idle_keys, args.rounds, args.slice)
            contention: dict[str, ContentionResult] = {}
            if not args.no_contention:
                keys = [impl.key for impl in IMPLS if impl.contend]
                contention = run_contention(client, server.url, prefix, keys, args)
            print()
            print(f"Idle: {args.rounds} interleaved rounds of {args.slice}s each, medians.", end="")
            if contention:
                print(
                    f" Contention: {args.procs} processes for {args.contention_seconds}s, limit "
                    f"{CONTENDED_LIMIT}, odd-numbered ones with time.time() {args.skew_ms:g} ms "
                    f"ahead, hold {args.hold_ms:g} ms."
                )
            else:
                print()
            report(idle, contention)
            vs_floor = idle.ratio("redsem", "floor")
            vs_lock = idle.ratio("redsem", "redis-lock")
            print()
            print(
                f"Target FairSemaphore >= {FLOOR_TARGET} x floor: "
                f"{'met' if vs_floor >= FLOOR_TARGET else 'MISSED'} ({vs_floor:.2f}, "
                f"rounds {idle.spread('redsem', 'floor')}); faster than redis-py Lock: "
                f"{'yes' if vs_lock > 1 else 'NO'} ({vs_lock:.2f}x, "
                f"rounds {idle.spread('redsem', 'redis-lock')})."
            )
            vs_held = idle.ratio("redsem", "held-floor")
            print(
                "On equal transport (the floor on a kept connection, as FairSemaphore sends its "
                f"calls): {vs_held:.2f} x (rounds {idle.spread('redsem', 'held-floor')}); "
                f">= {FLOOR_TARGET} there: {'yes' if vs_held >= FLOOR_TARGET else 'no'}."
            )
            missed = min(vs_floor, vs_held) < FLOOR_TARGET
            if args.breakdown == "always" or (args.breakdown == "auto" and missed):
                run_breakdown(client, server.url, prefix, max(3, args.rounds // 2), args.slice)
            if args.refresh_permits > 0:
                stall = run_refresh_stall(client, prefix, args.refresh_permits)
                print_stall(stall, args.refresh_permits)
        finally:
            deleted = delete_prefix(client, prefix)
            client.close()
    print(
        f"\nDeleted {deleted} keys under {prefix}:*; total time {time.monotonic() - started:.0f}s."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
