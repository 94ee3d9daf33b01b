"""Per-key rate: ``@with_rate_limit`` against Celery's own ``rate_limit``, two prefork workers.

Run with ``python -m benchmarks.rate [--hot N] [--cold N] [--rate R] [--brokers
redis,amqp]``. The workload is issue 22's acceptance: ``--hot`` (120) tasks on key "hot", then
``--cold`` (30) on key "cold", all sent at once, through two real ``celery worker -P prefork -c
C`` processes, once per variant:

* ``ours``: ``@with_rate_limit(f"{R}/s", key=...)`` per key, ``max_retries=0``;
* ``celery``: Celery's ``@app.task(rate_limit=f"{R}/s")``, the only rate limit Celery has: per
  worker and per task type, so two workers let through about ``2 x R`` a second, whatever the key.

Each body start is stamped with the Redis server's clock. Printed per variant and key: the most
starts in any one-second window (the target for ours: at most ``R`` + burst 1 per key; Celery's
figure for all keys together shows its ``workers x rate``), the time from the key's first send
to its last start against its ideal ``(N - 1) / R`` (targets: at most 1.15 x for the hot key,
1.3 x for the cold one), the largest gap between a task's place in the send order and in the
start order (first sent, first served), contention retries through the broker (trips) and failed
tasks. Then the budget scenarios (a cost per start, two windows: see
:mod:`benchmarks.rate.budgets`; ``--budgets``). RabbitMQ (``amqp``) is skipped with a printed
line when nothing answers at ``--amqp-url``. The workers' app is :mod:`benchmarks.rate.app`
(each worker loads :mod:`benchmarks.rate.worker`, which builds it from the environment).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from celery import Celery

from benchmarks._brokers import AMQP_URL, Broker, broker_legs, drop_queue
from benchmarks._server import bench_server, delete_prefix, unique_prefix
from benchmarks._workers import start_workers, stop_workers, wait_workers_ready
from benchmarks.rate.app import make_app, worker_environ
from benchmarks.rate.budgets import (
    PACE_TARGET,
    SCENARIOS,
    budget_lines,
    run_budget,
)

VARIANTS = ("ours", "celery")
HOT_TARGET = 1.15  # the hot key's time to its last start, at most this x its ideal
WORKER_APP = "benchmarks.rate.worker"  # what the workers' ``celery -A`` loads


@dataclass(frozen=True)
class KeyFigures:
    """What one key (or all keys: ``key`` "all") got in one run."""

    key: str
    starts: int
    most_in_a_second: int
    took: float  # the key's first send to its last start, seconds
    ideal: float  # (starts - 1) / rate
    displacement: int  # largest |place in send order - place in start order|
    trips: int  # contention retries through the broker


def most_in_a_second(starts: list[float]) -> int:
    """The most starts in any window [t, t + 1 s)."""
    return max((sum(1 for t in starts[i:] if t - s < 1.0) for i, s in enumerate(starts)), default=0)


def _figures(
    key: str, rows: list[tuple[float, int, int]], sent_at: float, rate: float
) -> KeyFigures:
    rows = sorted(rows)
    starts = [t for t, _, _ in rows]
    order = [n for _, n, _ in rows]
    ranks = {n: rank for rank, n in enumerate(sorted(order))}
    return KeyFigures(
        key=key,
        starts=len(rows),
        most_in_a_second=most_in_a_second(starts),
        took=starts[-1] - sent_at if starts else 0.0,
        ideal=(len(rows) - 1) / rate,
        displacement=max((abs(place - ranks[n]) for place, n in enumerate(order)), default=0),
        trips=sum(trips for _, _, trips in rows),
    )


@contextlib.contextmanager
def _fresh_workers(
    broker: Broker, url: str, args: argparse.Namespace
) -> Iterator[tuple[Celery, redis.Redis, str]]:
    """Two fresh workers under a new prefix, answering: the app, a client and the prefix."""
    prefix = unique_prefix()
    bench = make_app(url, broker.url, prefix, args.rate)
    client = redis.Redis.from_url(url)
    environ = worker_environ(url, broker.url, prefix, args.rate)
    names = [f"rate{n}-{prefix}" for n in (0, 1)]
    workers = start_workers(WORKER_APP, environ, names, args.concurrency)
    try:
        wait_workers_ready(bench, 2)
        yield bench, client, prefix
    finally:
        stop_workers(workers, grace=30)
        if not broker.is_redis:
            drop_queue(bench, prefix)
        delete_prefix(client, prefix)
        client.close()
        bench.close()


def run_variant(
    broker: Broker, url: str, variant: str, args: argparse.Namespace
) -> tuple[list[KeyFigures], int]:
    """One variant on fresh workers: the figures of each key and of all keys, and failures."""
    with _fresh_workers(broker, url, args) as (bench, client, prefix):
        task = bench.tasks[f"bench.{variant}"]
        keys = {"hot": args.hot, "cold": args.cold}
        sent_at: dict[str, float] = {}
        results = []
        for key, count in keys.items():
            seconds, micros = client.time()
            sent_at[key] = seconds + micros / 1e6
            results += [task.delay(key, n) for n in range(count)]
        timeout = (args.hot + args.cold) / args.rate * 3 + 60
        failed = 0
        for result in results:
            with contextlib.suppress(Exception):
                result.get(timeout=timeout, propagate=False)
            failed += result.state != "SUCCESS"
        rows: dict[str, list[tuple[float, int, int]]] = {}
        for key in keys:
            raw = client.lrange(f"{prefix}:starts:{variant}:{key}", 0, -1)
            rows[key] = [(float(t), int(n), int(c)) for t, n, c in (v.split() for v in raw)]
        figures = [_figures(key, rows[key], sent_at[key], args.rate) for key in keys]
        every = [(t, 0, c) for key in keys for t, _, c in rows[key]]
        figures.append(_figures("all", every, sent_at["hot"], args.rate))
        return figures, failed


def run_budgets(broker: Broker, url: str, args: argparse.Namespace) -> bool:
    """The budget scenarios on fresh workers: print their figures; True if all were met."""
    met = True
    with _fresh_workers(broker, url, args) as (bench, client, prefix):
        for name in args.budgets.split(","):
            figures = run_budget(bench, client, prefix, name, timeout=120)
            for line in budget_lines(broker.name, figures):
                print(line)
            met = met and figures.held and figures.failed == 0
            met = met and figures.took <= PACE_TARGET * figures.ideal
    return met


def _table(broker: Broker, results: dict[str, tuple[list[KeyFigures], int]]) -> None:
    print(
        f"{'broker':6s}  {'variant':7s}  {'key':4s}  {'starts':>6s}  {'most/1s':>7s}  "
        f"{'took':>6s}  {'ideal':>6s}  {'x ideal':>7s}  {'fifo gap':>8s}  {'trips':>5s}  failed"
    )
    for variant, (figures, failed) in results.items():
        for f in figures:
            ratio = f"{f.took / f.ideal:7.2f}" if f.ideal > 0 else "    n/a"
            fifo = "--" if f.key == "all" else str(f.displacement)
            print(
                f"{broker.name:6s}  {variant:7s}  {f.key:4s}  {f.starts:6d}  "
                f"{f.most_in_a_second:7d}  {f.took:6.2f}  {f.ideal:6.2f}  {ratio}  {fifo:>8s}  "
                f"{f.trips:5d}  {failed}"
            )


def _verdicts(results: dict[str, tuple[list[KeyFigures], int]], args: argparse.Namespace) -> bool:
    """Print each target with its figure and MET or MISSED; True if ours met every one."""
    ours, failed = results["ours"]
    by_key = {f.key: f for f in ours}
    hot, cold = by_key["hot"], by_key["cold"]
    bound = int(args.rate) + 1
    checks = [
        (
            f"ours: most starts in 1 s per key <= {bound}",
            max(hot.most_in_a_second, cold.most_in_a_second) <= bound,
            f"hot {hot.most_in_a_second}, cold {cold.most_in_a_second}",
        ),
        (
            f"ours: hot key's last start <= {HOT_TARGET} x ideal",
            hot.took <= HOT_TARGET * hot.ideal,
            f"{hot.took:.2f}s = {hot.took / hot.ideal:.2f} x {hot.ideal:.2f}s",
        ),
        (
            "ours: cold key near its own ideal (<= 1.3 x)",
            cold.took <= 1.3 * cold.ideal,
            f"{cold.took:.2f}s = {cold.took / cold.ideal:.2f} x {cold.ideal:.2f}s",
        ),
        ("ours: no task failed (max_retries=0)", failed == 0, f"{failed} failed"),
    ]
    for name, met, figure in checks:
        print(f"  {'MET   ' if met else 'MISSED'} {name}: {figure}")
    if "celery" in results:
        celery_all = {f.key: f for f in results["celery"][0]}["all"]
        print(
            f"  celery's rate_limit: {celery_all.most_in_a_second} starts in 1 s over both keys "
            f"(2 workers x {args.rate:g}/s = {2 * args.rate:g}); ours: "
            f"{by_key['all'].most_in_a_second} over both keys, {args.rate:g}/s per key"
        )
    return all(met for _, met, _ in checks)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hot", type=int, default=120, help="tasks on the hot key (120)")
    parser.add_argument("--cold", type=int, default=30, help="tasks on the cold key (30)")
    parser.add_argument("--rate", type=float, default=20.0, help="per key, a second (20)")
    parser.add_argument("--concurrency", type=int, default=4, help="slots per worker (4)")
    parser.add_argument("--brokers", default="redis,amqp", metavar="redis,amqp")
    parser.add_argument("--amqp-url", default=AMQP_URL, help="RabbitMQ (default: %(default)s)")
    parser.add_argument("--variants", default=",".join(VARIANTS), metavar="ours,celery")
    parser.add_argument(
        "--budgets",
        default=",".join(SCENARIOS),
        metavar="cost,windows",
        help="budget scenarios (issue 41) to run after the variants; 'none' for none",
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS) or "ours" not in variants:
        parser.error("--variants takes ours (always) and celery")
    if args.budgets == "none":
        args.budgets = ""
    if set(filter(None, args.budgets.split(","))) - set(SCENARIOS):
        parser.error(f"--budgets takes {', '.join(SCENARIOS)} or none")
    with contextlib.suppress(AttributeError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    met = True
    with bench_server() as server:
        for broker, host in broker_legs(args.brokers.split(","), server, args.amqp_url):
            print(f"\n== rate [broker {broker.name}] ==")
            print(host)
            print(
                f"{args.hot} tasks on 'hot' then {args.cold} on 'cold', {args.rate:g}/s per key, "
                f"two workers -c {args.concurrency}; {time.strftime('%Y-%m-%d %H:%M')}"
            )
            results = {v: run_variant(broker, server.url, v, args) for v in variants}
            _table(broker, results)
            met = _verdicts(results, args) and met
            if args.budgets:
                print(f"budgets: {args.budgets}, two fresh workers -c {args.concurrency}")
                met = run_budgets(broker, server.url, args) and met
    print(f"\nsummary: {'every target MET' if met else 'a target MISSED'}")
    return 0  # a measurement, not a test: exit 0 whether or not a target is met


if __name__ == "__main__":
    sys.exit(main())
