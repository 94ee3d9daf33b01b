"""Fair share by account: a grouped semaphore against a FIFO one, two prefork workers.

Run with ``python -m benchmarks.fair [--counts 300,300,30] [--hold S] [--brokers redis,amqp]
[--pool prefork] [--rounds N]``.
The workload is issue 40's acceptance: accounts a, b and c send 300, 300 and 30 tasks, in that
order, all at once, to a task under one shared limit of 4 (:mod:`benchmarks.fair.app`), through
two real ``celery worker -P prefork -c 4`` processes (``--pool``: another pool), once per
variant:

* ``fifo``: ``@with_semaphore(4, key=...)``, one line in arrival order;
* ``fair 1:1:1`` and ``fair 2:1:1``: ``fair_by`` the account, with those weights;
* ``capped``: fair 1:1:1 with ``group_limit=2``.

Each body start is stamped with the Redis server's clock. Printed per variant: each account's
share of the starts while all three have waiters (from c's first task's place in line, seen
through the semaphore's ``groups()``, to c's last start) against its weighted share (target:
within 0.05; also shown from c's first send, which adds the time c's messages take to reach a
worker behind the 600 sent before them), the time from c's first send to its last
start against the ideal at its fair share of the measured throughput (and FIFO's), throughput
against FIFO's (target: >= 0.95; with ``--rounds``, every variant runs that many times, in
turn, and the target holds for the median of each round's fair / FIFO), the most runs at
once (target: <= 4) and of one account (capped: <= 2), every task started once, and
contention retries through the broker. RabbitMQ (``amqp``) is skipped with a printed line
when nothing answers at ``--amqp-url``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from benchmarks._brokers import AMQP_URL, Broker, broker_legs, drop_queue
from benchmarks._server import bench_server, delete_prefix, unique_prefix
from benchmarks._workers import start_workers, stop_workers, wait_workers_ready
from benchmarks.fair.app import GROUP_LIMIT, LIMIT, make_app, worker_environ
from celery_redsem.core.state import read_groups

WORKER_APP = "benchmarks.fair.worker"  # what the workers' ``celery -A`` loads
ACCOUNTS = ("a", "b", "c")
#: (label, task variant, weights of a, b, c)
VARIANTS = (
    ("fifo", "fifo", (1.0, 1.0, 1.0)),
    ("fair 1:1:1", "fair", (1.0, 1.0, 1.0)),
    ("fair 2:1:1", "fair", (2.0, 1.0, 1.0)),
    ("capped", "capped", (1.0, 1.0, 1.0)),
)


@dataclass(frozen=True)
class Run:
    """What one variant got."""

    label: str
    weights: tuple[float, ...]
    shares: dict[str, float]  # of the starts from c's first send to its last start
    line_shares: dict[str, float]  # of the starts while c waits in line (the target's window)
    small_took: float  # c's first send to its last start, seconds
    rate: float  # starts a second, first start to last
    most: int  # runs at once, all accounts
    most_one: int  # runs at once of one account
    trips: int  # contention retries through the broker
    failed: int
    started: int  # body starts (every task once: the tasks sent)
    timeline: dict[str, str]  # per account: its starts over time (see _timeline)

    def deviation(self, *, in_line: bool = True) -> float:
        """The largest gap between an account's share and its weighted share: while c waits in
        line (``in_line``, the target's window), else from c's first send."""
        total = sum(self.weights)
        ideal = {a: w / total for a, w in zip(ACCOUNTS, self.weights, strict=True)}
        shares = self.line_shares if in_line else self.shares
        return max(abs(shares[a] - ideal[a]) for a in ACCOUNTS)

    def small_ideal(self, count: int) -> float:
        """c's tasks at its weighted share of this run's throughput."""
        return count / (self.rate * self.weights[2] / sum(self.weights))


def run_variant(broker: Broker, url: str, label: str, variant: str, weights: Any, args: Any) -> Run:
    """One variant on fresh workers."""
    prefix = unique_prefix()
    bench = make_app(url, broker.url, prefix, args.hold)
    client = redis.Redis.from_url(url)
    environ = worker_environ(url, broker.url, prefix, args.hold)
    names = [f"fair{n}-{prefix}" for n in (0, 1)]
    workers = start_workers(WORKER_APP, environ, names, 4, args.pool)
    try:
        wait_workers_ready(bench, 2)
        task = bench.tasks[f"bench.{variant}"]
        joined = _FirstInLine(url, prefix, f"bench-{variant}", "c")
        results, small_sent = [], 0.0
        for account, count, weight in zip(ACCOUNTS, args.counts, weights, strict=True):
            if account == "c":
                seconds, micros = client.time()
                small_sent = seconds + micros / 1e6
            results += [task.delay(account, weight) for _ in range(count)]
        failed = 0
        for result in results:
            with contextlib.suppress(Exception):
                result.get(timeout=sum(args.counts) * args.hold * 3 + 120, propagate=False)
            failed += result.state != "SUCCESS"
        small_joined = joined.stop() or small_sent
        raw: list[bytes] = client.lrange(f"{prefix}:starts:{variant}", 0, -1)  # type: ignore[assignment]
        rows = sorted((float(t), a.decode(), int(c)) for t, a, c in (v.split() for v in raw))
        small_last = max(t for t, a, _ in rows if a == "c")
        window = [a for t, a, _ in rows if small_sent <= t <= small_last]
        shares = {a: window.count(a) / max(1, len(window)) for a in ACCOUNTS}
        in_line = [a for t, a, _ in rows if small_joined <= t <= small_last]
        line_shares = {a: in_line.count(a) / max(1, len(in_line)) for a in ACCOUNTS}
        top = f"{prefix}:max:{variant}"
        return Run(
            label=label,
            weights=tuple(weights),
            shares=shares,
            line_shares=line_shares,
            small_took=small_last - small_sent,
            rate=(len(rows) - 1) / max(1e-9, rows[-1][0] - rows[0][0]),
            most=int(client.get(top) or 0),
            most_one=max(int(client.get(f"{top}:{a}") or 0) for a in ACCOUNTS),
            trips=sum(c for _, _, c in rows),
            failed=failed,
            started=len(rows),
            timeline=_timeline(rows),
        )
    finally:
        stop_workers(workers, grace=30)
        if not broker.is_redis:
            drop_queue(bench, prefix)
        delete_prefix(client, prefix)
        client.close()
        bench.close()


#: Starts of an account in one slice of the run, as a share of the most starts in any slice.
_SHADES = " .:-=+*#"
_SLICES = 60


def _timeline(rows: list[tuple[float, str, int]]) -> dict[str, str]:
    """Per account, a line of :data:`_SLICES` characters, one per slice of the run (first
    start to last): how many of its tasks started then (" " none ... "#" the most)."""
    first, span = rows[0][0], max(1e-9, rows[-1][0] - rows[0][0])
    counts = {a: [0] * _SLICES for a in ACCOUNTS}
    for t, account, _ in rows:
        counts[account][min(_SLICES - 1, int((t - first) / span * _SLICES))] += 1
    top = max(max(c) for c in counts.values())
    scale = len(_SHADES) - 1
    return {a: "".join(_SHADES[-(-n * scale // top)] for n in counts[a]) for a in ACCOUNTS}


class _FirstInLine:
    """When an account's first task joined the line of a grouped semaphore (waiting or
    holding), on the server's clock: polled with the semaphore's public ``groups()`` read
    every 2 ms from a thread, until seen (never on a FIFO semaphore: no groups)."""

    def __init__(self, url: str, prefix: str, name: str, group: str) -> None:
        self._client = redis.Redis.from_url(url)
        self._args = (name, prefix, group)
        self._stopped = threading.Event()
        self.at = 0.0
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        name, prefix, group = self._args
        while not self._stopped.wait(0.002):
            found = [g for g in read_groups(self._client, name, prefix=prefix) if g.group == group]
            if found and found[0].waiting + found[0].holders > 0:
                seconds, micros = self._client.time()
                self.at = seconds + micros / 1e6
                return

    def stop(self) -> float:
        """Stop polling; the time seen (0.0 if never)."""
        self._stopped.set()
        self._thread.join()
        self._client.close()
        return self.at


def _report(runs: list[Run], args: Any) -> bool:
    """Print a row per variant, then each target with MET or MISSED; True if all were met
    (with ``--rounds`` over 1, throughput is judged over the rounds: :func:`_over_rounds`)."""
    print(
        f"{'variant':10s}  {'share a':>7s}  {'share b':>7s}  {'share c':>7s}  {'dev':>5s}  "
        f"{'dev*':>5s}  "
        f"{'c took':>6s}  {'c ideal':>7s}  {'starts/s':>8s}  {'x fifo':>6s}  {'most':>4s}  "
        f"{'one':>3s}  {'trips':>5s}  failed"
    )
    fifo = runs[0]
    for r in runs:
        s = r.line_shares
        print(
            f"{r.label:10s}  {s['a']:7.3f}  {s['b']:7.3f}  {s['c']:7.3f}  {r.deviation():5.3f}  "
            f"{r.deviation(in_line=False):5.3f}  "
            f"{r.small_took:6.2f}  {r.small_ideal(args.counts[2]):7.2f}  {r.rate:8.1f}  "
            f"{r.rate / fifo.rate:6.2f}  {r.most:4d}  {r.most_one:3d}  {r.trips:5d}  {r.failed}"
        )
    print(
        "shares, dev: while c waits in line (its first task's place in line to its last start;"
        " fifo: from c's first send); dev*: from c's first send, its broker transit included"
    )
    print("starts over time (first start to last), per account:")
    for r in runs:
        for account in ACCOUNTS:
            print(f"  {r.label:10s} {account} |{r.timeline[account]}|")
    checks = []
    for r in runs[1:]:
        checks += [
            (
                f"{r.label}: shares within 0.05 of the weighted",
                r.deviation() <= 0.05,
                r.deviation(),
            ),
            (
                f"{r.label}: throughput >= 0.95 x fifo"
                + (" (this round)" if args.rounds > 1 else ""),
                r.rate >= 0.95 * fifo.rate or args.rounds > 1,
                r.rate / fifo.rate,
            ),
            (f"{r.label}: c done sooner than fifo", r.small_took < fifo.small_took, r.small_took),
        ]
    checks += [(f"{r.label}: at most {LIMIT} at once", r.most <= LIMIT, r.most) for r in runs]
    capped = runs[-1]
    checks.append(
        ("capped: at most 2 of one account", capped.most_one <= GROUP_LIMIT, capped.most_one)
    )
    checks.append(("no task failed", not any(r.failed for r in runs), sum(r.failed for r in runs)))
    sent = sum(args.counts)
    checks += [(f"{r.label}: every task started once", r.started == sent, r.started) for r in runs]
    # (Not a target for capped: the last account left runs at most GROUP_LIMIT at once.)
    checks = [c for c in checks if not c[0].startswith("capped: throughput")]
    for name, met, figure in checks:
        label = "      " if name.endswith("(this round)") else "MET   " if met else "MISSED"
        print(f"  {label} {name}: {figure:.3g}")
    return all(met for _, met, _ in checks)


def _over_rounds(rounds: list[list[Run]]) -> bool:
    """Each fair variant's throughput against the FIFO run of the same round, every round and
    the median (the target: >= 0.95); True if every median met it."""
    met = True
    print(f"\nthroughput / fifo of the same round, over {len(rounds)} interleaved rounds:")
    for index, (label, _, _) in enumerate(VARIANTS[1:-1], start=1):
        ratios = [runs[index].rate / runs[0].rate for runs in rounds]
        median = statistics.median(ratios)
        met = met and median >= 0.95
        figures = ", ".join(f"{r:.2f}" for r in ratios)
        print(
            f"  {'MET   ' if median >= 0.95 else 'MISSED'} {label}: {figures} (median {median:.3f})"
        )
    return met


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fair", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--counts", default="300,300,30", help="tasks of a, b, c (300,300,30)")
    parser.add_argument("--hold", type=float, default=0.02, help="body seconds (0.02)")
    parser.add_argument("--brokers", default="redis,amqp", metavar="redis,amqp")
    parser.add_argument("--amqp-url", default=AMQP_URL, help="RabbitMQ (default: %(default)s)")
    parser.add_argument(
        "--pool", default="prefork", choices=["prefork", "threads", "gevent", "eventlet"]
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="every variant this many times, interleaved (1)"
    )
    args = parser.parse_args()
    args.counts = [int(n) for n in args.counts.split(",")]
    if len(args.counts) != len(ACCOUNTS):
        parser.error("--counts takes three numbers")
    with contextlib.suppress(AttributeError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    met = True
    with bench_server() as server:
        for broker, host in broker_legs(args.brokers.split(","), server, args.amqp_url):
            print(f"\n== fair share [broker {broker.name}] ==")
            print(host)
            print(
                f"a, b, c send {', '.join(map(str, args.counts))} tasks in that order, limit "
                f"{LIMIT}, bodies {args.hold:g}s, two workers -P {args.pool} -c 4; "
                f"{time.strftime('%Y-%m-%d %H:%M')}"
            )
            rounds = []
            for number in range(1, args.rounds + 1):
                if args.rounds > 1:
                    print(f"-- round {number} of {args.rounds}")
                rounds.append([run_variant(broker, server.url, *v, args) for v in VARIANTS])
                met = _report(rounds[-1], args) and met
            if args.rounds > 1:
                met = _over_rounds(rounds) and met
    print(f"\nsummary: {'every target MET' if met else 'a target MISSED'}")
    return 0  # a measurement, not a test: exit 0 whether or not a target is met


if __name__ == "__main__":
    sys.exit(main())
