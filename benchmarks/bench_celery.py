"""End-to-end Celery benchmark: per-key limits through real prefork workers.

Run with ``make bench-celery`` (``python -m benchmarks.bench_celery``). One server (see
:mod:`benchmarks._server`) is broker, result backend and semaphore store; every key lives under
a unique prefix that is deleted afterwards.

N short tasks (default 400 x 50 ms) over K keys (8) with limit L per key (3) run on W worker
slots (2 prefork workers x 8). All tasks are sent at once, keys in a seeded random order.

* ``fair``: ``@with_semaphore`` (FIFO line; a near permit is awaited in the slot, else a
  contention retry with a position-aware countdown).
* ``naive``: the same semaphore tried without joining the line, retried with a fixed countdown
  (``--naive-countdown``, 0.1 s), the usual pattern of Celery lock plugins.

Before the first mode, ``--warmup`` uncontended guarded tasks (4 per slot, on keys and a task
name of their own) let every pool child connect to Redis and load the scripts, as a worker that
has been up for a while has; nothing the measured tasks learn (hold times, return delays) comes
from them. ``--warmup 0`` measures from cold children.

Each body counts itself in and out of a per-key counter that nothing else touches; a count
above L is an over-admission. ``wait`` is body start minus send time. The ideal is a simulated
work-conserving FIFO dispatcher with W slots and limit L per key, the same send times and the
measured mean body time: ``utilization`` = ideal makespan / real makespan, and ``p99 / ideal``
compares wait percentiles. Targets (fair): utilization >= 0.85, p99 wait <= 2 x ideal p99, no
over-admission. ``--dump PATH`` writes each mode's send times and body records to
``PATH.<mode>.json`` for a closer look.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_redsem import FairSemaphore, Permit, get_client, with_semaphore
from celery_redsem.integration.task_guard import WAIT_HEADER

ROOT = Path(__file__).resolve().parents[1]
ENV_URL, ENV_PREFIX, ENV_LIMIT = (
    "REDSEM_BENCH_APP_URL",
    "REDSEM_BENCH_APP_PREFIX",
    "REDSEM_BENCH_LIMIT",
)
ENV_NAIVE_COUNTDOWN = "REDSEM_BENCH_NAIVE_COUNTDOWN"
ENV_SETTINGS = "REDSEM_BENCH_SETTINGS"

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
) -> Celery:
    """The benchmark app: both task variants, results and records under ``prefix``."""
    app = Celery("redsembench", set_as_current=False)
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:celery:"},
        broker_connection_retry_on_startup=True,
        redsem_key_prefix=prefix,
        redsem_lease=5.0,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
    )
    app.conf.update(settings or {})
    clients: dict[int, redis.Redis] = {}

    def client() -> redis.Redis:
        return clients.setdefault(os.getpid(), redis.Redis.from_url(url))

    def body(mode: str, key: str, sent: float, seconds: float, request: Any) -> None:
        start = time.time()
        counter = f"{prefix}:b:{mode}:cur:{key}"
        client().eval(_ENTER, 2, counter, f"{prefix}:b:{mode}:over", limit)
        time.sleep(seconds)
        client().decr(counter)
        end = time.time()
        wait = (request.headers or {}).get(WAIT_HEADER) or [0]
        retries = wait[0] if mode == "fair" else request.retries
        record = json.dumps(
            {
                "key": key,
                "sent": sent,
                "start": start,
                "end": end,
                "retries": retries,
                "pid": os.getpid(),
            }
        )
        client().rpush(f"{prefix}:b:{mode}:done", record)

    @app.task(shared=False, bind=True, name="bench.fair")
    @with_semaphore(limit=limit, key=lambda key: f"fair:{key}")
    def fair(self: Any, key: str, sent: float, seconds: float) -> None:
        body("fair", key, sent, seconds, self.request)

    @app.task(shared=False, name="bench.warm")
    @with_semaphore(limit=1, key=lambda i: f"warm:{i}")
    def warm(i: int, seconds: float) -> None:
        time.sleep(seconds)
        client().incr(f"{prefix}:b:warm")

    @app.task(shared=False, bind=True, name="bench.plain")
    def plain(self: Any, key: str, sent: float, seconds: float) -> None:
        body("plain", key, sent, seconds, self.request)

    @app.task(shared=False, bind=True, name="bench.naive", max_retries=None)
    def naive(self: Any, key: str, sent: float, seconds: float) -> None:
        sem = FairSemaphore(get_client(app), f"naive:{key}", limit, lease=5.0, prefix=prefix)
        permit = sem.attempt(self.request.id)  # no waiting line
        if not isinstance(permit, Permit):
            raise self.retry(countdown=naive_countdown)
        try:
            body("naive", key, sent, seconds, self.request)
        finally:
            sem.release(permit)

    return app


if os.environ.get(ENV_URL):  # imported by `celery -A benchmarks.bench_celery worker`
    app = make_app(
        os.environ[ENV_URL],
        os.environ[ENV_PREFIX],
        int(os.environ[ENV_LIMIT]),
        float(os.environ.get(ENV_NAIVE_COUNTDOWN, "0.1")),
        json.loads(os.environ.get(ENV_SETTINGS, "{}")),
    )


# -- the ideal ----------------------------------------------------------------------------------


def ideal_schedule(
    sent: list[float], keys: list[str], slots: int, limit: int, duration: float
) -> list[float]:
    """Start times under a work-conserving FIFO dispatcher (earliest-sent runnable task first)."""
    n = len(sent)
    order = sorted(range(n), key=lambda i: sent[i])
    start = [0.0] * n
    running: list[tuple[float, int]] = []  # (end, task)
    per_key: Counter[str] = Counter()
    pending: list[int] = []
    now = 0.0
    nxt = 0
    while nxt < n or pending or running:
        while nxt < n and sent[order[nxt]] <= now:
            pending.append(order[nxt])
            nxt += 1
        started = True
        while started and len(running) < slots:
            started = False
            for j, i in enumerate(pending):
                if per_key[keys[i]] < limit:
                    start[i] = now
                    per_key[keys[i]] += 1
                    heapq.heappush(running, (now + duration, i))
                    del pending[j]
                    started = True
                    break
        events = [running[0][0]] if running else []
        if nxt < n:
            events.append(sent[order[nxt]])
        if not events:
            break
        now = min(events)
        while running and running[0][0] <= now:
            _, i = heapq.heappop(running)
            per_key[keys[i]] -= 1
    return start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# -- running --------------------------------------------------------------------------------------


@dataclass
class Result:
    mode: str
    makespan: float
    ideal_makespan: float
    p50: float
    p99: float
    ideal_p50: float
    ideal_p99: float
    over: int
    retries: int

    @property
    def utilization(self) -> float:
        return self.ideal_makespan / self.makespan


def start_workers(
    url: str, prefix: str, args: argparse.Namespace, logs: Path
) -> list[subprocess.Popen[bytes]]:
    env = {
        **os.environ,
        ENV_URL: url,
        ENV_PREFIX: prefix,
        ENV_LIMIT: str(args.limit),
        ENV_NAIVE_COUNTDOWN: str(args.naive_countdown),
        ENV_SETTINGS: json.dumps(args.settings),
        "PYTHONPATH": str(ROOT),
    }
    procs = []
    for i in range(args.workers):
        log = (logs / f"bench-worker-{i}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", "benchmarks.bench_celery", "worker"),
                    *("-P", "prefork", "-c", str(args.concurrency), "-n", f"bench{i}@%h"),
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


def warm_up(app: Celery, client: redis.Redis, prefix: str, args: argparse.Namespace) -> None:
    """Let every pool child connect and load the scripts before anything is measured.

    Guarded tasks on keys of their own (no contention, and a task name of their own, so the
    measured tasks start with nothing learnt), a few per slot, so that each child gets some.
    """
    if args.warmup <= 0:
        return
    for i in range(args.warmup):
        app.tasks["bench.warm"].apply_async((i, 0.02))
    deadline = time.monotonic() + args.timeout
    while int(client.get(f"{prefix}:b:warm") or 0) < args.warmup:
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up not done in {args.timeout}s")
        time.sleep(0.05)


def run_mode(
    app: Celery, client: redis.Redis, prefix: str, mode: str, args: argparse.Namespace
) -> Result:
    rng = random.Random(args.seed)
    keys = [f"k{rng.randrange(args.keys)}" for _ in range(args.tasks)]
    task = app.tasks[f"bench.{mode}"]
    sent = []
    for key in keys:
        now = time.time()
        sent.append(now)
        task.apply_async((key, now, args.duration))
    done_key = f"{prefix}:b:{mode}:done"
    deadline = time.monotonic() + args.timeout
    while client.llen(done_key) < args.tasks:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{mode}: only {client.llen(done_key)}/{args.tasks} tasks done in {args.timeout}s"
            )
        time.sleep(0.05)
    records = [json.loads(r) for r in client.lrange(done_key, 0, -1)]
    if args.dump:
        with open(f"{args.dump}.{mode}.json", "w") as f:
            json.dump({"sent": sent, "keys": keys, "records": records}, f)
    t0 = min(sent)
    makespan = max(r["end"] for r in records) - t0
    waits = [r["start"] - r["sent"] for r in records]
    body = sum(r["end"] - r["start"] for r in records) / len(records)
    ideal_start = ideal_schedule(
        [s - t0 for s in sent], keys, args.workers * args.concurrency, args.limit, body
    )
    ideal_waits = [ideal_start[i] - (sent[i] - t0) for i in range(len(sent))]
    ideal_makespan = max(ideal_start) + body
    return Result(
        mode=mode,
        makespan=makespan,
        ideal_makespan=ideal_makespan,
        p50=percentile(waits, 0.5),
        p99=percentile(waits, 0.99),
        ideal_p50=percentile(ideal_waits, 0.5),
        ideal_p99=percentile(ideal_waits, 0.99),
        over=int(client.get(f"{prefix}:b:{mode}:over") or 0),
        retries=sum(r["retries"] for r in records),
    )


def report(results: list[Result], args: argparse.Namespace, version: str) -> None:
    slots = args.workers * args.concurrency
    print(
        f"celery e2e: {args.tasks} tasks x {args.duration * 1000:.0f} ms, {args.keys} keys, "
        f"limit {args.limit}, {args.workers} workers x {args.concurrency} slots ({slots}), "
        f"prefetch {args.prefetch}, {version}"
    )
    columns = ["makespan", "ideal", "util", "p50 wait", "p99 wait", "ideal p50", "ideal p99"]
    columns += ["p99/ideal", "over", "retries"]
    header = f"{'mode':<6}" + "".join(f"{c:>10}" for c in columns)
    print(header)
    print("-" * len(header))
    for r in results:
        cells = [f"{r.makespan:.2f}s", f"{r.ideal_makespan:.2f}s", f"{r.utilization:.2f}"]
        cells += [f"{v:.2f}s" for v in (r.p50, r.p99, r.ideal_p50, r.ideal_p99)]
        cells += [f"{r.p99 / r.ideal_p99:.2f}", str(r.over), str(r.retries)]
        print(f"{r.mode:<6}" + "".join(f"{c:>10}" for c in cells))
    fair = next((r for r in results if r.mode == "fair"), None)
    if fair is not None:
        ok = fair.utilization >= 0.85 and fair.p99 <= 2 * fair.ideal_p99 and fair.over == 0
        print(
            f"targets (fair): utilization >= 0.85 [{fair.utilization:.2f}], p99 <= 2 x ideal "
            f"[{fair.p99 / fair.ideal_p99:.2f}], over-admissions 0 [{fair.over}]: "
            + ("MET" if ok else "MISSED")
        )


def main(argv: list[str] | None = None) -> int:
    from benchmarks._server import bench_server, delete_prefix, unique_prefix

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--keys", type=int, default=8)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=0.05, help="seconds per task body")
    parser.add_argument("--prefetch", type=int, default=4, help="worker prefetch multiplier")
    parser.add_argument("--naive-countdown", type=float, default=0.1)
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="uncontended guarded tasks run first so every pool child is connected "
        "(default: 4 per slot; 0: none)",
    )
    parser.add_argument("--modes", default="fair,naive,plain")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--dump", metavar="PATH", help="write each mode's records to PATH.MODE.json"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a redsem_* setting for the workers",
    )
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 4 * args.workers * args.concurrency
    args.settings = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    with bench_server() as server:
        prefix = unique_prefix()
        client = redis.Redis.from_url(server.url)
        app = make_app(server.url, prefix, args.limit, args.naive_countdown, args.settings)
        procs = start_workers(server.url, prefix, args, logs)
        try:
            wait_workers_ready(app, args.workers)
            warm_up(app, client, prefix, args)
            results = [run_mode(app, client, prefix, mode, args) for mode in args.modes.split(",")]
        finally:
            stop_workers(procs)
            app.close()
            delete_prefix(client, prefix)
            client.close()
    report(results, args, server.version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
