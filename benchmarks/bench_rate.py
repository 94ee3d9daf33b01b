"""Per-key rate: ``@with_rate_limit`` against Celery's own ``rate_limit``, two prefork workers.

Run with ``python -m benchmarks.bench_rate [--tasks N] [--rate R] [--concurrency C]``. The same
workload (``--tasks`` (60) empty tasks on one key, all sent at once) goes through two real
``celery worker -c C`` processes twice: once with ``@with_rate_limit(f"{R}/s")`` on the key,
once with Celery's ``@app.task(rate_limit=f"{R}/s")``. Each start is stamped with the server's
clock; printed per variant: the most starts in any one-second window (the target: at most
``R`` + burst 1), the achieved rate over the run, and the makespan against the ideal
``(N - 1) / R``. Celery's limit is per worker, so two workers let through about ``2 x R``.
The module is also the workers' app (``-A benchmarks.bench_rate``, set up from env).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import redis
from celery import Celery

from benchmarks._brokers import cpu_model
from benchmarks._server import bench_server, delete_prefix, unique_prefix
from celery_redsem import with_rate_limit

ROOT = Path(__file__).resolve().parents[1]
_ENV = ("REDSEM_BENCH_APP_URL", "REDSEM_BENCH_APP_PREFIX", "REDSEM_BENCH_APP_RATE")


def make_app(url: str, prefix: str, rate: float) -> Celery:
    """The benchmark's app: both variants of the task, starts logged on the server's clock."""
    app = Celery("bench_rate", set_as_current=False)
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:celery:"},
        redsem_key_prefix=prefix,
        worker_hijack_root_logger=False,
    )
    clients: dict[int, redis.Redis] = {}

    def stamp(variant: str) -> None:
        client = clients.setdefault(os.getpid(), redis.Redis.from_url(url))
        seconds, micros = client.time()
        client.rpush(f"{prefix}:starts:{variant}", seconds * 1_000_000 + micros)

    @app.task(shared=False, name="bench.ours", max_retries=0)
    @with_rate_limit(rate, key="bench")
    def ours() -> None:
        stamp("ours")

    @app.task(shared=False, name="bench.celerys", rate_limit=f"{rate}/s")
    def celerys() -> None:
        stamp("celerys")

    return app


if all(name in os.environ for name in _ENV):  # a worker of this benchmark
    app = make_app(*(os.environ[name] for name in _ENV[:2]), float(os.environ[_ENV[2]]))


def _most_in_a_second(starts: list[float]) -> int:
    return max((sum(1 for t in starts[i:] if t - s < 1.0) for i, s in enumerate(starts)), default=0)


def _run(url: str, variant: str, tasks: int, rate: float, concurrency: int) -> str:
    prefix = unique_prefix()
    env = {
        **os.environ,
        "REDSEM_BENCH_APP_URL": url,
        "REDSEM_BENCH_APP_PREFIX": prefix,
        "REDSEM_BENCH_APP_RATE": str(rate),
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "celery", "-A", "benchmarks.bench_rate", "worker"]
    options = ["-P", "prefork", "-c", str(concurrency), "-l", "WARNING", "--without-gossip"]
    workers = [
        subprocess.Popen(
            [*command, *options, "--without-mingle", "-n", f"{variant}{n}@%h"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for n in range(2)
    ]
    bench = make_app(url, prefix, rate)
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 60
        while len(bench.control.ping(timeout=0.5)) < 2 and time.monotonic() < deadline:
            pass
        results = [bench.tasks[f"bench.{variant}"].delay() for _ in range(tasks)]
        for result in results:
            result.get(timeout=tasks / rate * 2 + 30)
        starts = sorted(int(v) / 1e6 for v in client.lrange(f"{prefix}:starts:{variant}", 0, -1))
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(30)
        delete_prefix(client, prefix)
        client.close()
        bench.close()
    makespan = starts[-1] - starts[0]
    ideal = (tasks - 1) / rate
    return (
        f"{variant:8s} most starts in 1 s: {_most_in_a_second(starts):3d} (target <= "
        f"{rate:g} + 1)  achieved {(tasks - 1) / makespan:6.1f}/s  makespan {makespan:5.2f}s "
        f"(ideal {ideal:.2f}s, {makespan / ideal:.2f} x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=60)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    with bench_server() as server:
        print(f"host: {os.cpu_count()} CPUs, {cpu_model()}; server {server.version}")
        print(
            f"{args.tasks} tasks on one key at {args.rate:g}/s, two workers -c {args.concurrency}"
        )
        for variant in ("ours", "celerys"):
            print(_run(server.url, variant, args.tasks, args.rate, args.concurrency), flush=True)


if __name__ == "__main__":
    main()
