"""Contention: processes (half with a clock running ahead) loop acquire, hold, release at
a small limit; a counter no implementation touches catches over-admissions."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from benchmarks.core.contenders import BY_KEY

CONTENDED_LIMIT = 3


@dataclass(frozen=True)
class Job:
    """One contention run, as sent to every worker process."""

    impl: str
    prefix: str
    limit: int
    seconds: float
    hold: float
    counter: str


@dataclass(frozen=True)
class WorkerResult:
    """What one worker process saw during one run."""

    index: int
    skewed: bool
    grants: int
    over: int
    max_seen: int
    error: str = ""


def _skew_clock(seconds: float) -> None:
    """Make this process's ``time.time()`` run ``seconds`` ahead (monotonic clocks untouched)."""
    real = time.time

    def skewed() -> float:
        return real() + seconds

    time.time = skewed


def _contend(job: Job, client: redis.Redis, index: int, skewed: bool) -> WorkerResult:
    impl = BY_KEY[job.impl].factory(client, job.prefix, job.limit)
    rng = random.Random(index)
    grants = over = max_seen = 0
    end = time.monotonic() + job.seconds
    while (now := time.monotonic()) < end:
        handle = impl.acquire_within(end - now)
        if handle is None:
            time.sleep(rng.uniform(0.0002, 0.001))
            continue
        holding = int(client.incr(job.counter))
        grants += 1
        max_seen = max(max_seen, holding)
        over += holding > job.limit
        time.sleep(job.hold)
        client.decr(job.counter)
        impl.release(handle)
    return WorkerResult(index, skewed, grants, over, max_seen)


def contention_worker(
    index: int,
    url: str,
    skew: float,
    jobs: mp.Queue[Job | None],
    results: mp.Queue[WorkerResult],
    barrier: Any,
) -> None:
    """A worker process: run every job it is given, in step with the others, until ``None``."""
    skewed = skew != 0.0
    if skewed:
        _skew_clock(skew)
    client = redis.Redis.from_url(url)
    while (job := jobs.get()) is not None:
        try:
            barrier.wait(timeout=60)
            results.put(_contend(job, client, index, skewed))
        except Exception as exc:
            results.put(WorkerResult(index, skewed, 0, 0, 0, error=f"{type(exc).__name__}: {exc}"))
    client.close()


@dataclass(frozen=True)
class ContentionResult:
    """Totals of one contention run."""

    limit: int
    grants: int
    over: int
    max_seen: int
    skewed_share: float
    grants_per_s: float
    errors: list[str]


class WorkerPool:
    """``procs`` long-lived worker processes (half with a skewed clock), reused for every run."""

    def __init__(self, url: str, procs: int, skew: float) -> None:
        ctx = mp.get_context("spawn")
        self.procs = procs
        self.jobs: mp.Queue[Job | None] = ctx.Queue()
        self.results: mp.Queue[WorkerResult] = ctx.Queue()
        self.barrier = ctx.Barrier(procs + 1)
        self.workers = [
            ctx.Process(
                target=contention_worker,
                args=(i, url, skew if i % 2 else 0.0, self.jobs, self.results, self.barrier),
                daemon=True,
            )
            for i in range(procs)
        ]
        for worker in self.workers:
            worker.start()

    def run(self, job: Job) -> ContentionResult:
        """Run ``job`` in every worker at once and add up what they saw."""
        for _ in range(self.procs):
            self.jobs.put(job)
        self.barrier.wait(timeout=120)
        started = time.monotonic()
        parts = [self.results.get(timeout=job.seconds + 60) for _ in range(self.procs)]
        elapsed = time.monotonic() - started
        grants = sum(p.grants for p in parts)
        skewed = sum(p.grants for p in parts if p.skewed)
        return ContentionResult(
            limit=job.limit,
            grants=grants,
            over=sum(p.over for p in parts),
            max_seen=max(p.max_seen for p in parts),
            skewed_share=skewed / grants if grants else float("nan"),
            grants_per_s=grants / elapsed,
            errors=[f"worker {p.index}: {p.error}" for p in parts if p.error],
        )

    def close(self) -> None:
        """Tell every worker to stop and wait for it (terminate a straggler)."""
        for _ in self.workers:
            self.jobs.put(None)
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
                worker.join()


def run_contention(
    client: redis.Redis, url: str, prefix: str, keys: Sequence[str], args: argparse.Namespace
) -> dict[str, ContentionResult]:
    """One contention run per implementation, all with the same pool of worker processes."""
    pool = WorkerPool(url, args.procs, args.skew_ms / 1000)
    out: dict[str, ContentionResult] = {}
    try:
        for key in keys:
            impl = BY_KEY[key]
            run_prefix = f"{prefix}:{key}"
            job = Job(
                impl=key,
                prefix=run_prefix,
                limit=1 if impl.lock_only else CONTENDED_LIMIT,
                seconds=args.contention_seconds,
                hold=args.hold_ms / 1000,
                counter=f"{run_prefix}:holding",
            )
            out[key] = pool.run(job)
            left = int(client.get(job.counter) or 0)
            if left:
                out[key].errors.append(f"holder counter ended at {left}, not 0")
    finally:
        pool.close()
    return out
