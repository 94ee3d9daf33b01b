"""The Celery benchmark's command line (``python -m benchmarks.celery_e2e``): its options, and
each scenario asked for run on each broker asked for. What it measures and how: the package's
docstring (:mod:`benchmarks.celery_e2e`)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import traceback
from collections.abc import Callable

from benchmarks._brokers import AMQP_URL, broker_legs
from benchmarks._server import bench_server
from benchmarks.celery_e2e import hot, scenarios, stops
from benchmarks.celery_e2e.harness import POOL_CONCURRENCY, Bench, open_bench, pool_slots

#: Every scenario by name; ``--scenario all`` runs issue 19's three (``ALL``).
SCENARIOS: dict[str, Callable[[Bench], bool]] = {
    **scenarios.SCENARIOS,
    "pools": stops.pools,
    "hot-mixed": hot.hot_mixed,
}
ALL = list(scenarios.SCENARIOS)

HELP = """\
End-to-end Celery benchmark: per-key limits through real workers (-P prefork by default;
--pool threads,gevent,eventlet runs each scenario on each pool, -c 20/100/100 unless
--pool-concurrency says otherwise, the baseline and plain batches on the same pool).

scenarios (--scenario NAME[,NAME] or all), each on every broker of --brokers, phases side by side:
  backlog      --backlog-tasks (1000) x 20 ms on ONE key, limit 2: unguarded on a dedicated
               worker -c 2 (baseline), guarded on 1 worker -c 4 and on 2 workers -c 4, then the
               burst again with --others (20) tasks for other keys sent after it. Targets: pace
               vs baseline >= 0.9, re-publishes/task <= 0.1, no over-admission, others <= 1 s.
  uncontended  --uncontended-tasks (600) x 10 ms over --uncontended-keys (300), 1 worker -c 4:
               guarded throughput >= 0.95 x plain (median of --rounds, guarded and plain
               batches in turns on the same worker).
  mixed        the classic run with modes fair,plain (--rounds of each, in turns on the same
               workers; medians): fair utilization >= 0.9 and >= 0.95 x plain's, p99 wait
               <= 1.5 x ideal p99, no over-admission. On threads/gevent/eventlet (--workers
               x the pool's concurrency) plain runs far past the limit: fair/plain is judged
               over the limit's own ceiling.
  pools        the backlog burst on one worker of the pool: run through, stopped by SIGTERM
               once a third ran, stopped by SIGKILL (acks_late); a fresh worker finishes;
               the ledger of every task (ran once, again after a cut body, an ack in flight,
               twice, lost). Targets: no loss, no double, never over the limit.
  hot-mixed    --hot-tasks (2000) x 100 ms over 200 keys (hot key 30%), limit 3, one worker
               -c --hot-concurrency (200): utilization of the ideal FIFO dispatcher >= 0.85,
               no over-admission (run it with --pool gevent).
all: backlog, uncontended, mixed. Several pools and several scenarios: each scenario on
each broker on each pool.
without --scenario: the classic run of --modes (fair,naive,plain) on the Redis broker.
--scale multiplies every task count (0.1 for a smoke run). RabbitMQ (--amqp-url) is skipped
with a printed line when nothing answers there."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.celery_e2e",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="make bench-celery runs --scenario all; "
        "make bench-celery BENCH_ARGS='--scale 0.1' runs a small smoke run of it",
    )
    parser.add_argument(
        "--scenario",
        metavar="NAME[,NAME]",
        help=f"named scenarios: {', '.join(SCENARIOS)} or all ({', '.join(ALL)}) "
        "(default: the classic run of --modes)",
    )
    parser.add_argument(
        "--brokers",
        metavar="redis,amqp",
        help="brokers to run on (default: redis,amqp with --scenario, else redis)",
    )
    parser.add_argument("--amqp-url", default=AMQP_URL, help="RabbitMQ (default: %(default)s)")
    parser.add_argument(
        "--pool",
        default="prefork",
        metavar="POOL[,POOL]",
        help=f"the workers' pool(s): {', '.join(POOL_CONCURRENCY)} (default: %(default)s)",
    )
    parser.add_argument(
        "--pool-concurrency",
        type=int,
        metavar="N",
        help="each worker's -c on the pool (default: threads 20, gevent 100, eventlet 100; "
        "prefork: each scenario's own, 4 and the mixed 8)",
    )
    parser.add_argument(
        "--logs", metavar="DIR", help="where the workers' logs go (default: $TMPDIR or /tmp)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every task count (0.1: a smoke run)"
    )
    group = parser.add_argument_group("classic run and the mixed scenario")
    group.add_argument("--tasks", type=int, default=400)
    group.add_argument("--keys", type=int, default=8)
    group.add_argument("--limit", type=int, default=3)
    group.add_argument("--workers", type=int, default=2)
    group.add_argument("--concurrency", type=int, default=8)
    group.add_argument("--duration", type=float, default=0.05, help="seconds per task body")
    group.add_argument(
        "--modes", help="fair,naive,plain (default: all three; the mixed scenario: fair,plain)"
    )
    group.add_argument("--naive-countdown", type=float, default=0.1)
    group.add_argument("--seed", type=int, default=7)
    scenarios.add_arguments(parser.add_argument_group("backlog, uncontended and pools scenarios"))
    hot.add_arguments(parser.add_argument_group("hot-mixed scenario"))
    parser.add_argument("--prefetch", type=int, default=4, help="worker prefetch multiplier")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="uncontended guarded tasks run first so every pool child is connected "
        "(default: 4 per slot; 0: none)",
    )
    parser.add_argument(
        "--pre-queue",
        action="store_true",
        help="send each batch while the workers do not consume, so that no sender shares the "
        "CPUs with the batch (a diagnostic, not a scenario's setting)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per phase")
    parser.add_argument(
        "--dump", metavar="PATH", help="write each phase's records to PATH.BROKER.PHASE.json"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a redsem_* setting for the workers",
    )
    args = parser.parse_args(argv)
    args.settings = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    if args.scenario in (None, "all"):
        names = ALL if args.scenario else ["mixed"]
    else:
        names = args.scenario.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}")
    args.names = names
    args.modes = (args.modes or ("fair,plain" if args.scenario else "fair,naive,plain")).split(",")
    args.brokers = (args.brokers or ("redis,amqp" if args.scenario else "redis")).split(",")
    if set(args.brokers) - {"redis", "amqp"}:
        parser.error("--brokers takes redis and/or amqp")
    args.pools = args.pool.split(",")
    if set(args.pools) - set(POOL_CONCURRENCY):
        parser.error(f"--pool takes {', '.join(POOL_CONCURRENCY)}")
    return args


def on_pool(args: argparse.Namespace, pool: str) -> argparse.Namespace:
    """``args`` for the runs on ``pool`` (a copy: ``pool`` set)."""
    mine = copy.copy(args)
    mine.pool = pool
    return mine


def run(args: argparse.Namespace) -> int:
    """Every scenario in ``args.names`` on every broker in ``args.brokers``; 1 if one failed."""
    with contextlib.suppress(AttributeError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    verdicts: list[str] = []

    def skipped(name: str) -> None:
        verdicts.append(f"{name}: skipped")

    with bench_server() as server:
        for broker, host in broker_legs(args.brokers, server, args.amqp_url, skipped):
            for pool in args.pools:
                for scenario in args.names:
                    where = broker.name if pool == "prefork" else f"{broker.name}, -P {pool}"
                    print(f"\n== {scenario} [broker {where}] ==")
                    print(host + load_line(args, pool, scenario))
                    try:
                        with open_bench(server, broker, on_pool(args, pool)) as bench:
                            verdict = "MET" if SCENARIOS[scenario](bench) else "MISSED"
                    except Exception as exc:
                        traceback.print_exc()
                        verdict = f"FAILED ({exc})"
                    print(f"{scenario} [{where}]: {verdict}")
                    verdicts.append(f"{scenario} [{where}]: {verdict}")
    print("\nsummary: " + "; ".join(verdicts))
    return 1 if any("FAILED" in v for v in verdicts) else 0


def load_line(args: argparse.Namespace, pool: str, scenario: str) -> str:
    """The pool, its concurrency and the host's 1-minute load average now."""
    try:
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
    except OSError:
        load = "?"
    size = "" if pool == "prefork" else f" -c {pool_slots(on_pool(args, pool))}"
    if scenario == "hot-mixed":
        size = f" -c {args.hot_concurrency}"
    return f"; -P {pool}{size}; load average (1 min) {load}"


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
