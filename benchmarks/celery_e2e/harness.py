"""Running batches on real workers: start a set of workers for a phase, send a batch of tasks,
wait until every body has run, and collect what the bodies and the workers recorded.

A scenario runs on a :class:`Bench` (:func:`open_bench`: one broker, a unique prefix, the
driver's app) and gets each phase's :class:`Batch` from :func:`run_batch` (fresh workers) or
:func:`run_rounds` (batches of two modes in turns on the same workers, with their CPU cost).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from benchmarks._brokers import Broker, drop_queue
from benchmarks._server import BenchServer, delete_prefix, unique_prefix
from benchmarks._workers import ROOT, stop_workers, wait_workers_ready
from benchmarks.celery_e2e.app import WorkerConfig, make_app
from benchmarks.cpu import CpuMeter, CpuReading, local_redis_pid, per_task

WORKER_APP = "benchmarks.celery_e2e.worker"  # what the workers' ``celery -A`` loads


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


#: Each pool's default concurrency (``--pool-concurrency`` overrides it): issue 38's sizes for
#: threads, gevent and eventlet; prefork's is each scenario's own (``-c 4``, the mixed ``-c 8``).
POOL_CONCURRENCY = {"prefork": 4, "threads": 20, "gevent": 100, "eventlet": 100}


def pool_name(args: argparse.Namespace) -> str:
    return str(getattr(args, "pool", None) or "prefork")


def pool_slots(args: argparse.Namespace, prefork: int | None = None) -> int:
    """A worker's concurrency on the run's pool: ``--pool-concurrency`` if given, else
    ``prefork`` (a scenario's own size) on prefork, else the pool's default."""
    given = getattr(args, "pool_concurrency", None)
    if given:
        return int(given)
    pool = pool_name(args)
    return prefork if pool == "prefork" and prefork else POOL_CONCURRENCY[pool]


def run_name(bench: Bench) -> str:
    """The broker, and the pool unless it is prefork: ``redis``, ``amqp.gevent``."""
    pool = pool_name(bench.args)
    return bench.broker.name if pool == "prefork" else f"{bench.broker.name}.{pool}"


def log_dir(args: argparse.Namespace) -> Path:
    path = Path(getattr(args, "logs", None) or os.environ.get("TMPDIR", "/tmp"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_workers(
    bench: Bench,
    tag: str,
    workers: int,
    concurrency: int,
    limit: int,
    logs: Path,
    *,
    names: list[str] | None = None,
    settings: dict[str, Any] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """``workers`` worker subprocesses on the run's pool (``--pool``), each in a session of its
    own (a signal to its process group reaches its pool children), logging to ``logs``;
    ``names`` their node names (default ``bench<i>``), ``settings`` more app settings."""
    args = bench.args
    config = WorkerConfig(
        url=bench.url,
        broker_url=bench.broker.url,
        prefix=bench.prefix,
        limit=limit,
        tag=tag,
        naive_countdown=args.naive_countdown,
        settings={**args.settings, **(settings or {})},
        stamps=bool(args.dump),
    )
    env = {
        **os.environ,
        **config.environ(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    procs = []
    for name in names or [f"bench{i}" for i in range(workers)]:
        log = (logs / f"bench-worker-{run_name(bench)}-{tag}-{name}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", WORKER_APP, "worker"),
                    *("-P", pool_name(args), "-c", str(concurrency), "-n", f"{name}@%h"),
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
    procs = start_workers(bench, tag, workers, concurrency, limit, log_dir(bench.args))
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
    pre_queue = bench.args.pre_queue
    if pre_queue:
        _consume(bench, "cancel_consumer", workers)
    sent = publish(bench, mode, tag, keys, seconds)
    if pre_queue:
        sent = [time.time()] * len(keys)
        _consume(bench, "add_consumer", workers)
    wait_done(bench, tag, len(keys))
    return sent


def publish(bench: Bench, mode: str, tag: str, keys: list[str], seconds: float) -> list[float]:
    """Send one task of ``mode`` per key, ids ``tag.<n>``, at once; the send times."""
    task = bench.app.tasks[f"bench.{mode}"]
    sent = []
    for i, key in enumerate(keys):
        now = time.time()
        sent.append(now)
        task.apply_async((key, now, seconds, tag), task_id=f"{tag}.{i}")
    return sent


def wait_done(bench: Bench, tag: str, count: int) -> None:
    """Wait until ``count`` bodies of batch ``tag`` have run (``--timeout`` at most)."""
    done_key = f"{bench.prefix}:b:{tag}:done"
    deadline = time.monotonic() + bench.args.timeout
    while (done := bench.client.llen(done_key)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tag}: only {done}/{count} tasks done in {bench.args.timeout}s")
        time.sleep(0.05)


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
        with open(f"{bench.args.dump}.{run_name(bench)}.{tag}.json", "w") as f:
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


@contextlib.contextmanager
def open_bench(server: BenchServer, broker: Broker, args: argparse.Namespace) -> Iterator[Bench]:
    """A scenario's run: its own prefix, queue and app; everything of it deleted afterwards."""
    prefix = unique_prefix()
    client = redis.Redis.from_url(server.url)
    app = make_app(server.url, prefix, args.limit, args.naive_countdown, args.settings, broker.url)
    try:
        yield Bench(app, client, server.url, broker, prefix, args)
    finally:
        if not broker.is_redis:
            drop_queue(app, prefix)
        app.close()
        delete_prefix(client, prefix)
        client.close()
