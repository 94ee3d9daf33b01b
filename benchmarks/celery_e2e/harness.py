"""End-to-end Celery benchmark: per-key limits through real prefork workers.

Run with ``make bench-celery`` (every scenario, both brokers) or ``python -m
benchmarks.celery_e2e [--scenario NAME[,NAME]] [--brokers redis,amqp] [--scale F]``. One
server (see :mod:`benchmarks._server`) holds results, semaphores and the bodies' records; it is
also the ``redis`` broker. ``amqp`` is RabbitMQ (see :mod:`benchmarks._brokers`), skipped with
a printed line where nothing answers. Each scenario on each broker runs under a unique prefix
(its keys, its queue, its control exchange) that is deleted afterwards, and starts fresh
workers for each of its phases, so phases measured side by side share nothing but the host.

Scenarios (:mod:`benchmarks.celery_e2e.scenarios`; sizes by option, all task counts times
``--scale``):

* ``backlog``: ``--backlog-tasks`` (1,000) x 20 ms on ONE key, limit 2. ``baseline``: the tasks
  unguarded on a dedicated worker ``-c 2``; ``guarded``: ``@with_semaphore`` on one worker
  ``-c 4``; ``spread``: guarded on two workers ``-c 4``; ``head-of-line``: the guarded burst
  again, then ``--others`` (20) tasks for 20 other keys sent after it. Targets: pace (baseline
  makespan / makespan) >= 0.9 and contention re-publishes per task <= 0.1 for guarded and
  spread, no over-admission, the 20 others done within 1 s of their first send.
* ``uncontended``: ``--uncontended-tasks`` (600) x 10 ms over ``--uncontended-keys`` (300,
  round robin, limit 2) on one worker ``-c 4``, guarded and plain: throughput ratio >= 0.95.
* ``mixed``: the classic run below with modes ``fair,plain``: fair utilization >= 0.9, >= 0.95 x
  plain's, p99 wait <= 1.5 x the ideal p99, no over-admission.

``uncontended`` and ``mixed`` run ``--rounds`` (3) batches of each mode on the same workers, in
turns (guarded, plain; plain, guarded; ...), and take each figure as the median of the rounds':
a 2 s batch on a shared 2-vCPU host varies by 10-20% from one run to the next, far more than
the difference measured, and batches next to each other on the same workers see the same host.
Both also print the CPU a guarded and a plain task cost, in milliseconds per task, by process:
the workers' main processes, their pool children and the Redis servers on this host
(:mod:`benchmarks.cpu`; Linux only).

Without ``--scenario``, the classic run, on the Redis broker unless ``--brokers`` says
otherwise: N short tasks (``--tasks`` 400 x ``--duration`` 50 ms) over ``--keys`` (8) with
``--limit`` (3) per key on ``--workers`` (2) prefork workers x ``--concurrency`` (8), all sent
at once, keys in a seeded random order, in each of ``--modes`` (default ``fair,naive,plain``):

* ``fair``: ``@with_semaphore``, the plugin under test (its FIFO line per key).
* ``naive``: the same semaphore tried without joining the line, retried with a fixed countdown
  (``--naive-countdown``, 0.1 s), the usual pattern of Celery lock plugins.
* ``plain``: no semaphore at all.

Before each phase, ``--warmup`` uncontended guarded tasks (4 per slot, on keys and a task name
of their own) let every pool child connect to Redis and load the scripts, as a worker that has
been up for a while has; nothing the measured tasks learn (hold times, return delays) comes
from them. ``--warmup 0`` measures from cold children.

Each body counts itself in and out of a per-key counter that nothing else touches; a count
above the limit is an over-admission. ``wait`` is body start minus send time; ``re-pub`` counts
contention retries through the broker (the ``redsem_wait`` header's first element, or the
naive task's retries); ``deliv`` counts deliveries the workers received (``task_received``),
1.0 per task when nothing goes through the broker twice. The ideal is a simulated
work-conserving FIFO dispatcher with W slots and limit L per key, the same send times and the
measured mean body time: ``utilization`` = ideal makespan / real makespan, and ``p99 / ideal``
compares wait percentiles (``n/a`` when the ideal p99 is under 1 ms). ``--dump PATH`` writes
each phase's send times and body records to ``PATH.<broker>.<phase>.json`` for a closer look
(:mod:`benchmarks.celery_e2e.dump_report` shows where a batch lost time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun, task_received, worker_shutdown

from benchmarks._brokers import AMQP_URL, Broker
from benchmarks.cpu import CpuMeter, CpuReading, local_redis_pid, per_task
from celery_redsem import FairSemaphore, Permit, get_client, with_semaphore
from celery_redsem.integration.waiting import WAIT_HEADER

ROOT = Path(__file__).resolve().parents[2]
WORKER_APP = "benchmarks.celery_e2e.harness"  # what the workers' ``celery -A`` loads
ENV_URL, ENV_BROKER, ENV_PREFIX, ENV_LIMIT, ENV_TAG = (
    "REDSEM_BENCH_APP_URL",
    "REDSEM_BENCH_BROKER_URL",
    "REDSEM_BENCH_APP_PREFIX",
    "REDSEM_BENCH_LIMIT",
    "REDSEM_BENCH_TAG",
)
ENV_NAIVE_COUNTDOWN = "REDSEM_BENCH_NAIVE_COUNTDOWN"
ENV_SETTINGS = "REDSEM_BENCH_SETTINGS"
ENV_STAMPS = "REDSEM_BENCH_STAMPS"

_ENTER = """
local c = redis.call('INCR', KEYS[1])
if c > tonumber(ARGV[1]) then redis.call('INCR', KEYS[2]) end
return c
"""


def make_app(
    url: str,
    prefix: str,
    limit: int,
    naive_countdown: float,
    settings: dict[str, Any] | None = None,
    broker_url: str | None = None,
) -> Celery:
    """The benchmark app: the task variants, results and records under ``prefix``.

    The broker is ``broker_url`` (default: ``url``); tasks go to the queue ``prefix`` and
    control messages to the exchange ``prefix.pidbox``, so no other run sees them.
    """
    broker_url = broker_url or url
    app = Celery("redsembench", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=url,
        task_default_queue=prefix,
        control_exchange=prefix,
        result_backend_transport_options={"global_keyprefix": f"{prefix}:celery:"},
        broker_connection_retry_on_startup=True,
        redsem_key_prefix=prefix,
        redsem_lease=5.0,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
    )
    if not broker_url.startswith("amqp"):
        app.conf.broker_transport_options = {"global_keyprefix": f"{prefix}:kombu:"}
    app.conf.update(settings or {})
    clients: dict[int, redis.Redis] = {}

    def client() -> redis.Redis:  # (one per process: a forked pool child makes its own)
        pid = os.getpid()
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(url)
        return clients[pid]

    def body(mode: str, tag: str, key: str, sent: float, seconds: float, request: Any) -> None:
        start = time.time()
        counter = f"{prefix}:b:{tag}:cur:{key}"
        client().eval(_ENTER, 2, counter, f"{prefix}:b:{tag}:over", limit)
        time.sleep(seconds)
        client().decr(counter)
        end = time.time()
        wait = getattr(request, WAIT_HEADER, None) or (request.headers or {}).get(WAIT_HEADER)
        retries = (wait or [0])[0] if mode == "fair" else request.retries
        record = {
            "key": key,
            "sent": sent,
            "start": start,
            "end": end,
            "retries": retries,
            "pid": os.getpid(),
            "worker": request.hostname,
            "id": request.id,
        }
        record.update(child_stamps.take(request.id))
        client().rpush(f"{prefix}:b:{tag}:done", json.dumps(record))

    @app.task(shared=False, bind=True, name="bench.fair")
    @with_semaphore(limit=limit, key=lambda key: f"fair:{key}")
    def fair(self: Any, key: str, sent: float, seconds: float, tag: str = "fair") -> None:
        body("fair", tag, key, sent, seconds, self.request)

    @app.task(shared=False, name="bench.warm")
    @with_semaphore(limit=1, key=lambda i: f"warm:{i}")
    def warm(i: int, seconds: float, tag: str = "") -> None:
        time.sleep(seconds)
        client().incr(f"{prefix}:b:{tag}:warm")

    @app.task(shared=False, bind=True, name="bench.plain")
    def plain(self: Any, key: str, sent: float, seconds: float, tag: str = "plain") -> None:
        body("plain", tag, key, sent, seconds, self.request)

    @app.task(shared=False, bind=True, name="bench.naive", max_retries=None)
    def naive(self: Any, key: str, sent: float, seconds: float, tag: str = "naive") -> None:
        sem = FairSemaphore(get_client(app), f"naive:{key}", limit, lease=5.0, prefix=prefix)
        permit = sem.attempt(self.request.id)  # no waiting line
        if not isinstance(permit, Permit):
            raise self.retry(countdown=naive_countdown)
        try:
            body("naive", tag, key, sent, seconds, self.request)
        finally:
            sem.release(permit)

    return app


class ChildStamps:
    """In a pool child, with :data:`ENV_STAMPS` set (``--dump``): when Celery began each task
    (``task_prerun``) and finished the one before (``task_postrun``), for the next record.

    A record is pushed from inside its body, before its own ``task_postrun``; so each record
    carries the previous run's ``postrun`` in this process (``prev``, with its id): no extra
    round trip, and nothing else on the task's path but two signal receivers.
    """

    def __init__(self) -> None:
        self.prerun: dict[str, float] = {}
        self.postrun: tuple[str, float] | None = None

    def connect(self) -> None:
        task_prerun.connect(self._on_prerun, weak=False, dispatch_uid=f"{__name__}.prerun")
        task_postrun.connect(self._on_postrun, weak=False, dispatch_uid=f"{__name__}.postrun")

    def _on_prerun(self, task_id: str = "", **_: Any) -> None:
        self.prerun[task_id] = time.time()

    def _on_postrun(self, task_id: str = "", **_: Any) -> None:
        self.postrun = (task_id, time.time())

    def take(self, task_id: str) -> dict[str, Any]:
        """The stamps to add to ``task_id``'s record (none unless connected)."""
        stamps: dict[str, Any] = {}
        prerun = self.prerun.pop(task_id, None)
        if prerun is not None:
            stamps["prerun"] = prerun
        if self.postrun is not None:
            stamps["prev"] = list(self.postrun)
            self.postrun = None
        return stamps


child_stamps = ChildStamps()


def count_deliveries(url: str, prefix: str, tag: str) -> None:
    """In a worker: count the measured tasks it receives, by batch; add the counts up at
    shutdown, and count the worker (tagged ``tag``) as flushed.

    A measured task's id is ``<batch tag>.<n>`` (:func:`send_batch`): counted in memory by
    that tag (nothing on the dispatch path but a dict update) and written once, to
    ``prefix:b:<batch tag>:received``, when the worker stops.
    """
    received: Counter[str] = Counter()

    @task_received.connect(weak=False)
    def _received(request: Any = None, **_: Any) -> None:
        if getattr(request, "name", "") != "bench.warm":
            received[str(getattr(request, "id", "")).rpartition(".")[0]] += 1

    @worker_shutdown.connect(weak=False)
    def _flush(**_: Any) -> None:
        client = redis.Redis.from_url(url)
        try:
            pipe = client.pipeline()
            for batch, count in received.items():
                pipe.incrby(f"{prefix}:b:{batch}:received", count)
            pipe.incr(f"{prefix}:b:{tag}:flushed")
            pipe.execute()
        finally:
            client.close()


if os.environ.get(ENV_URL):  # imported by `celery -A benchmarks.celery_e2e.harness worker`
    app = make_app(
        os.environ[ENV_URL],
        os.environ[ENV_PREFIX],
        int(os.environ[ENV_LIMIT]),
        float(os.environ.get(ENV_NAIVE_COUNTDOWN, "0.1")),
        json.loads(os.environ.get(ENV_SETTINGS, "{}")),
        os.environ.get(ENV_BROKER),
    )
    count_deliveries(os.environ[ENV_URL], os.environ[ENV_PREFIX], os.environ.get(ENV_TAG, "-"))
    if os.environ.get(ENV_STAMPS):
        child_stamps.connect()


# -- running --------------------------------------------------------------------------------------


@dataclass
class Bench:
    """One scenario on one broker: the driver's app and client, and the run's unique prefix."""

    app: Celery
    client: redis.Redis
    url: str
    broker: Broker
    prefix: str
    args: argparse.Namespace


@dataclass
class Batch:
    """One phase: what was sent when, the bodies' records, and what the workers counted."""

    tag: str
    sent: list[float]
    keys: list[str]
    records: list[dict[str, Any]]
    over: int
    received: int | None  # deliveries the workers received (None: a worker did not report)
    cpu: CpuReading | None = None  # CPU milliseconds per task (None: not measured)

    def of(self, keys: set[str]) -> list[dict[str, Any]]:
        return [r for r in self.records if r["key"] in keys]

    @property
    def makespan(self) -> float:
        return float(max(r["end"] for r in self.records) - min(self.sent))

    @property
    def body(self) -> float:
        return float(sum(r["end"] - r["start"] for r in self.records) / len(self.records))

    @property
    def retries(self) -> int:
        return sum(r["retries"] for r in self.records)


def start_workers(
    bench: Bench, tag: str, workers: int, concurrency: int, limit: int, logs: Path
) -> list[subprocess.Popen[bytes]]:
    args = bench.args
    env = {
        **os.environ,
        ENV_URL: bench.url,
        ENV_BROKER: bench.broker.url,
        ENV_PREFIX: bench.prefix,
        ENV_LIMIT: str(limit),
        ENV_TAG: tag,
        ENV_NAIVE_COUNTDOWN: str(args.naive_countdown),
        ENV_SETTINGS: json.dumps(args.settings),
        ENV_STAMPS: "1" if args.dump else "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    procs = []
    for i in range(workers):
        log = (logs / f"bench-worker-{bench.broker.name}-{tag}-{i}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", WORKER_APP, "worker"),
                    *("-P", "prefork", "-c", str(concurrency), "-n", f"bench{i}@%h"),
                    *("-l", os.environ.get("REDSEM_BENCH_LOGLEVEL", "WARNING")),
                    *("--without-gossip", "--without-mingle", "--without-heartbeat"),
                    f"--prefetch-multiplier={args.prefetch}",
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return procs


def stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_workers_ready(app: Celery, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replies = app.control.ping(timeout=0.5) or []
        if len(replies) >= count:
            return
    raise RuntimeError(f"{count} workers did not come up within {timeout}s")


def warm_up(bench: Bench, tag: str, count: int) -> None:
    """Let every pool child connect and load the scripts before anything is measured.

    Guarded tasks on keys of their own (no contention, and a task name of their own, so the
    measured tasks start with nothing learnt), a few per slot, so that each child gets some.
    """
    if count <= 0:
        return
    for i in range(count):
        bench.app.tasks["bench.warm"].apply_async((i, 0.02, tag))
    deadline = time.monotonic() + bench.args.timeout
    while int(bench.client.get(f"{bench.prefix}:b:{tag}:warm") or 0) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tag}: warm-up not done in {bench.args.timeout}s")
        time.sleep(0.05)


@contextlib.contextmanager
def worker_set(
    bench: Bench, tag: str, *, workers: int, concurrency: int, limit: int
) -> Iterator[list[int]]:
    """Fresh workers for one phase, ready and warmed up (their process ids); stopped (warm
    shutdown) afterwards."""
    procs = start_workers(
        bench, tag, workers, concurrency, limit, Path(os.environ.get("TMPDIR", "/tmp"))
    )
    try:
        wait_workers_ready(bench.app, workers)
        warm = bench.args.warmup
        warm_up(bench, tag, 4 * workers * concurrency if warm is None else warm)
        yield [proc.pid for proc in procs]
    finally:
        stop_workers(procs)


def run_batch(
    bench: Bench,
    mode: str,
    tag: str,
    keys: list[str],
    seconds: float,
    *,
    workers: int,
    concurrency: int,
    limit: int,
) -> Batch:
    """Send one task of ``mode`` per key in ``keys`` (in order, at once) to fresh workers and
    wait until every body has run; the workers' delivery count is read after they stop."""
    with worker_set(bench, tag, workers=workers, concurrency=concurrency, limit=limit):
        sent = send_batch(bench, mode, tag, keys, seconds, workers=workers)
    return collect_batch(bench, tag, keys, sent, worker_tag=tag, workers=workers)


def run_rounds(
    bench: Bench,
    modes: tuple[str, str],
    keys: list[str],
    seconds: float,
    *,
    rounds: int,
    workers: int,
    concurrency: int,
    limit: int,
) -> dict[str, list[Batch]]:
    """``rounds`` batches of each of two modes, one after the other on the same workers, the
    order swapped every round (A B, B A, A B, ...) so that a host slowing down or speeding up
    during the run weighs on both alike. Batch ``r`` of ``mode`` is tagged ``mode-r``."""
    tag = "-".join(modes)
    sent: dict[str, list[float]] = {}
    cpu: dict[str, CpuReading | None] = {}
    with worker_set(bench, tag, workers=workers, concurrency=concurrency, limit=limit) as pids:
        servers = [bench.url, *([bench.broker.url] if bench.broker.is_redis else [])]
        meter = CpuMeter(pids, [local_redis_pid(url) for url in servers])
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                batch_tag = f"{mode}-{r}"
                before = meter.read()
                sent[batch_tag] = send_batch(bench, mode, batch_tag, keys, seconds, workers=workers)
                cpu[batch_tag] = per_task(before, meter.read(), len(keys))
    batches: dict[str, list[Batch]] = {mode: [] for mode in modes}
    for mode in modes:
        for r in range(rounds):
            batch_tag = f"{mode}-{r}"
            batch = collect_batch(
                bench, batch_tag, keys, sent[batch_tag], worker_tag=tag, workers=workers
            )
            batch.cpu = cpu[batch_tag]
            batches[mode].append(batch)
    return batches


def send_batch(
    bench: Bench, mode: str, tag: str, keys: list[str], seconds: float, *, workers: int
) -> list[float]:
    """Send one task of ``mode`` per key (ids ``tag.<n>``) and wait until every body has run;
    the send times. With ``--pre-queue`` the ``workers`` stop consuming while the batch is sent,
    and every task counts as sent when they start again."""
    task = bench.app.tasks[f"bench.{mode}"]
    done_key = f"{bench.prefix}:b:{tag}:done"
    pre_queue = bench.args.pre_queue
    if pre_queue:
        _consume(bench, "cancel_consumer", workers)
    sent = []
    for i, key in enumerate(keys):
        now = time.time()
        sent.append(now)
        task.apply_async((key, now, seconds, tag), task_id=f"{tag}.{i}")
    if pre_queue:
        sent = [time.time()] * len(keys)
        _consume(bench, "add_consumer", workers)
    deadline = time.monotonic() + bench.args.timeout
    while (done := bench.client.llen(done_key)) < len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{tag}: only {done}/{len(keys)} tasks done in {bench.args.timeout}s"
            )
        time.sleep(0.05)
    return sent


def _consume(bench: Bench, command: str, workers: int) -> None:
    """Have the run's ``workers`` stop (``cancel_consumer``) or start again (``add_consumer``)
    consuming its queue, and wait until each has replied that it did (10 s at most)."""
    replies = getattr(bench.app.control, command)(
        bench.prefix, reply=True, timeout=10, limit=workers
    )
    if len(replies or ()) < workers:
        raise RuntimeError(f"{command}: {len(replies or ())} of {workers} workers replied in 10 s")


def collect_batch(
    bench: Bench, tag: str, keys: list[str], sent: list[float], *, worker_tag: str, workers: int
) -> Batch:
    """What batch ``tag`` left behind, read once its workers (tagged ``worker_tag``) stopped."""
    records = [json.loads(r) for r in bench.client.lrange(f"{bench.prefix}:b:{tag}:done", 0, -1)]
    if bench.args.dump:
        with open(f"{bench.args.dump}.{bench.broker.name}.{tag}.json", "w") as f:
            json.dump({"sent": sent, "keys": keys, "records": records}, f)
    received: int | None = int(bench.client.get(f"{bench.prefix}:b:{tag}:received") or 0)
    if int(bench.client.get(f"{bench.prefix}:b:{worker_tag}:flushed") or 0) != workers:
        received = None  # a worker did not stop cleanly: its count is missing
    return Batch(
        tag=tag,
        sent=sent,
        keys=keys,
        records=records,
        over=int(bench.client.get(f"{bench.prefix}:b:{tag}:over") or 0),
        received=received,
    )


# -- the command line -----------------------------------------------------------------------------

HELP = """\
End-to-end Celery benchmark: per-key limits through real prefork workers.

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
               <= 1.5 x ideal p99, no over-admission.
without --scenario: the classic run of --modes (fair,naive,plain) on the Redis broker.
--scale multiplies every task count (0.1 for a smoke run). RabbitMQ (--amqp-url) is skipped
with a printed line when nothing answers there."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from benchmarks.celery_e2e import scenarios

    parser = argparse.ArgumentParser(
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="make bench-celery runs --scenario all; "
        "make bench-celery BENCH_ARGS='--scale 0.1' runs a small smoke run of it",
    )
    parser.add_argument(
        "--scenario",
        metavar="NAME[,NAME]",
        help=f"named scenarios: {', '.join(scenarios.SCENARIOS)} or all "
        "(default: the classic run of --modes)",
    )
    parser.add_argument(
        "--brokers",
        metavar="redis,amqp",
        help="brokers to run on (default: redis,amqp with --scenario, else redis)",
    )
    parser.add_argument("--amqp-url", default=AMQP_URL, help="RabbitMQ (default: %(default)s)")
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
    scenarios.add_arguments(parser.add_argument_group("backlog and uncontended scenarios"))
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
        names = list(scenarios.SCENARIOS) if args.scenario else ["mixed"]
    else:
        names = args.scenario.split(",")
    unknown = [n for n in names if n not in scenarios.SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}")
    args.names = names
    args.modes = (args.modes or ("fair,plain" if args.scenario else "fair,naive,plain")).split(",")
    args.brokers = (args.brokers or ("redis,amqp" if args.scenario else "redis")).split(",")
    if set(args.brokers) - {"redis", "amqp"}:
        parser.error("--brokers takes redis and/or amqp")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.celery_e2e import scenarios

    return scenarios.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
