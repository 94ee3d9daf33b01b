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
import gc
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from benchmarks._server import bench_server, delete_prefix, unique_prefix
from benchmarks.core.refresh_stall import print_stall, run_refresh_stall
from benchmarks.core.seed_semaphores import (
    BasicSemaphore,
    CounterFairSemaphore,
    LockedFairSemaphore,
)
from celery_redsem import FairSemaphore, Permit

IDLE_LIMIT = 5
CONTENDED_LIMIT = 3
FLOOR_TARGET = 0.85
BATCH = 10
TRIVIAL_SCRIPT = "return 1"


# -- implementations under test -----------------------------------------------------------------


class Contender(Protocol):
    """What the benchmark needs from an implementation: try once, give back."""

    def try_acquire(self) -> object | None:
        """One non-blocking attempt: a handle for :meth:`release`, or None."""

    def acquire_within(self, seconds: float) -> object | None:
        """The implementation's natural way to get a permit within ``seconds`` (or None)."""

    def release(self, handle: Any) -> None:
        """Give back what :meth:`try_acquire` returned."""


class _TryOnly:
    """Mixin: an implementation without a waiting mode tries once."""

    def try_acquire(self) -> object | None:
        raise NotImplementedError

    def acquire_within(self, seconds: float) -> object | None:
        return self.try_acquire()


class Floor(_TryOnly):
    """Two bare ``EVALSHA`` round trips of a trivial script: the cost floor of a pair."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.client = client
        self.sha = str(client.script_load(TRIVIAL_SCRIPT))

    def try_acquire(self) -> object | None:
        reply: object = self.client.evalsha(self.sha, 0)
        return reply

    def release(self, handle: Any) -> None:
        self.client.evalsha(self.sha, 0)


class HeldFloor(Floor):
    """The floor's two ``EVALSHA`` calls over one kept connection (a single-connection client),
    the transport FairSemaphore's acquire and release use (celery_redsem/lane.py): the floor
    without the pool checkout that every plain client call pays."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        super().__init__(client, prefix, limit)
        self.client = redis.Redis(
            connection_pool=client.connection_pool, single_connection_client=True
        )


class Redsem:
    """celery_redsem's FairSemaphore; ``acquire_within`` waits in the FIFO line."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = FairSemaphore(client, "bench", limit, prefix=prefix)

    def try_acquire(self) -> object | None:
        return self.sem.acquire()

    def acquire_within(self, seconds: float) -> object | None:
        return self.sem.acquire(blocking=True, timeout=seconds)

    def release(self, handle: Any) -> None:
        self.sem.release(handle)


class RedsemTry(Redsem):
    """FairSemaphore driven like the seeds: try once, back off, try again."""

    def acquire_within(self, seconds: float) -> object | None:
        return self.try_acquire()


class RedisPyLock(_TryOnly):
    """``redis.lock.Lock`` (always a limit of 1)."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.lock = client.lock(f"{prefix}:redis-py-lock", timeout=10)

    def try_acquire(self) -> object | None:
        return True if self.lock.acquire(blocking=False) else None

    def release(self, handle: Any) -> None:
        self.lock.release()


class _Seed(_TryOnly):
    """Adapter for the seed semaphores (acquire returns an id or None)."""

    sem: BasicSemaphore | CounterFairSemaphore

    def try_acquire(self) -> object | None:
        return self.sem.acquire()

    def release(self, handle: Any) -> None:
        self.sem.release(handle)


class SeedBasic(_Seed):
    """Seed 1: sorted set scored by client timestamps."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = BasicSemaphore(client, f"{prefix}:seed-basic", limit)


class SeedFair(_Seed):
    """Seed 2: counter + owner set, two pipelines."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = CounterFairSemaphore(client, f"{prefix}:seed-fair", limit)


class SeedLockedFair(_Seed):
    """Seed 3: seed 2 under a SETNX lock with a 10 ms acquire timeout."""

    def __init__(self, client: redis.Redis, prefix: str, limit: int) -> None:
        self.sem = LockedFairSemaphore(client, f"{prefix}:seed-locked", limit)


Factory = Callable[[redis.Redis, str, int], Contender]


@dataclass(frozen=True)
class Impl:
    """One row of the report."""

    key: str
    label: str
    factory: Factory
    idle_key: str | None = None  # reuse another row's idle numbers
    lock_only: bool = False  # contention with limit 1
    contend: bool = True


IMPLS: list[Impl] = [
    Impl("floor", "floor: 2x EVALSHA 'return 1'", Floor, contend=False),
    Impl("held-floor", "  same, on a kept connection", HeldFloor, contend=False),
    Impl("redsem", "FairSemaphore, FIFO wait", Redsem),
    Impl("redsem-try", "FairSemaphore, try+backoff", RedsemTry, idle_key="redsem"),
    Impl("redis-lock", "redis-py Lock (limit 1)", RedisPyLock, lock_only=True),
    Impl("seed-basic", "seed: basic zset", SeedBasic),
    Impl("seed-fair", "seed: fair (counter)", SeedFair),
    Impl("seed-locked", "seed: fair + SETNX lock", SeedLockedFair),
]
BY_KEY = {impl.key: impl for impl in IMPLS}


# -- idle throughput ------------------------------------------------------------------------------


def pairs_per_second(impl: Contender, seconds: float) -> float:
    """Run acquire+release pairs on an idle semaphore for about ``seconds``; return pairs/s."""
    gc.collect()
    done = 0
    start = time.perf_counter()
    end = start + seconds
    while True:
        for _ in range(BATCH):
            handle = impl.try_acquire()
            if handle is None:
                raise RuntimeError(f"{type(impl).__name__} refused a permit on an idle semaphore")
            impl.release(handle)
        done += BATCH
        now = time.perf_counter()
        if now >= end:
            return done / (now - start)


@dataclass
class IdleResult:
    """Per-round pairs/s of every implementation measured idle."""

    rounds: dict[str, list[float]] = field(default_factory=dict)

    def median(self, key: str) -> float:
        """Median pairs/s over the rounds."""
        return statistics.median(self.rounds[key])

    def ratio(self, key: str, base: str) -> float:
        """Median over rounds of ``key``'s pairs/s divided by ``base``'s in the same round."""
        return statistics.median(self._ratios(key, base))

    def spread(self, key: str, base: str) -> str:
        """Lowest and highest per-round ratio, as ``lo..hi``."""
        ratios = self._ratios(key, base)
        return f"{min(ratios):.2f}..{max(ratios):.2f}"

    def _ratios(self, key: str, base: str) -> list[float]:
        return [a / b for a, b in zip(self.rounds[key], self.rounds[base], strict=True)]


@dataclass
class Interleaved:
    """Per round and implementation: wall and client-CPU seconds per pair."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def interleave(impls: dict[str, Contender], rounds: int, slice_s: float) -> Interleaved:
    """Let the implementations take turns in batches of ``BATCH`` pairs, ``rounds`` times.

    A round lasts ``slice_s`` per implementation. The order is shuffled every turn: in a
    fixed or rotating order each implementation always follows the same one, and what ran
    just before shows in the timing (two copies of FairSemaphore measured 0.84 and 0.86 x
    floor when one of them always followed the floor). A round's figure for an
    implementation is the time spent in its own batches over its pairs.
    """
    keys = list(impls)
    order = random.Random(0)  # the same sequence of orders in every run
    out = Interleaved({key: [] for key in keys}, {key: [] for key in keys})
    for impl in impls.values():  # warm up: load scripts, open the connection
        pairs_per_second(impl, min(0.05, slice_s))
    for _ in range(rounds):
        wall = dict.fromkeys(keys, 0.0)
        cpu = dict.fromkeys(keys, 0.0)
        turns = 0
        gc.collect()
        gc.disable()
        try:
            end = time.perf_counter() + slice_s * len(keys)
            while time.perf_counter() < end:
                order.shuffle(keys)
                for key in keys:
                    impl = impls[key]
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    for _ in range(BATCH):
                        handle = impl.try_acquire()
                        if handle is None:
                            raise RuntimeError(f"{key} refused a permit on an idle semaphore")
                        impl.release(handle)
                    wall[key] += time.perf_counter() - wall0
                    cpu[key] += time.process_time() - cpu0
                turns += 1
        finally:
            gc.enable()
        for key in keys:
            out.wall[key].append(wall[key] / (turns * BATCH))
            out.cpu[key].append(cpu[key] / (turns * BATCH))
    return out


def run_idle(
    client: redis.Redis, prefix: str, keys: Sequence[str], rounds: int, slice_s: float
) -> IdleResult:
    """Idle pairs/s of the implementations ``keys``, interleaved (see :func:`interleave`)."""
    impls = {key: BY_KEY[key].factory(client, prefix, IDLE_LIMIT) for key in keys}
    seconds = interleave(impls, rounds, slice_s).wall
    return IdleResult({key: [1 / t for t in seconds[key]] for key in keys})


# -- where the time goes -----------------------------------------------------------------------


class _Recording(redis.Redis):
    """A client that remembers every command it sends and the reply (to replay them)."""

    sent: list[tuple[Any, Any]]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        self.sent.append((args, reply))
        return reply


class SameShape(_TryOnly):
    """FairSemaphore's recorded commands with trivial scripts: the cost of its arguments.

    Each script is swapped for one that at once returns a reply of the same shape (a grant,
    which comes as a status line, as the same status line).
    """

    def __init__(self, url: str, prefix: str, limit: int) -> None:
        recorder = _Recording(connection_pool=redis.ConnectionPool.from_url(url))
        recorder.sent = []
        sem = FairSemaphore(recorder, "shape", limit, prefix=prefix)
        sem.release(_granted(sem.acquire()))  # load the scripts
        recorder.sent.clear()
        sem.release(_granted(sem.acquire()))
        # Replayed over one kept connection, as FairSemaphore sends them (lane.py).
        self.client = redis.Redis.from_url(url, single_connection_client=True)
        self.calls: list[tuple[Any, ...]] = []
        for args, reply in recorder.sent:
            if str(args[0]).upper() != "EVALSHA":
                raise RuntimeError(f"FairSemaphore sent {args[0]!r} on an idle semaphore")
            if isinstance(reply, list):
                shape = "{" + ", ".join("1" for _ in reply) + "}"
            elif isinstance(reply, bytes):  # a grant: '<token>:<expiry>'
                shape = "{ok = '" + reply.decode() + "'}"
            else:
                shape = "1"
            sha = str(self.client.script_load(f"return {shape}"))
            self.calls.append(("EVALSHA", sha, *args[2:]))
        recorder.close()

    def try_acquire(self) -> object | None:
        for call in self.calls:
            self.client.execute_command(*call)  # type: ignore[no-untyped-call]
        return True

    def release(self, handle: Any) -> None:
        """Nothing: :meth:`try_acquire` already replayed the release too."""


def _granted(permit: Permit | None) -> Permit:
    if permit is None:
        raise RuntimeError("FairSemaphore refused a permit on an idle semaphore")
    return permit


SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def _script_usec(client: redis.Redis) -> tuple[int, int]:
    """Calls and server microseconds of script commands so far (scripts' inner calls excluded)."""
    stats = client.info("commandstats")
    calls = usec = 0
    for name in SCRIPT_COMMANDS:
        entry = stats.get(f"cmdstat_{name}", {})
        calls += int(entry.get("calls", 0))
        usec += int(entry.get("usec", 0))
    return calls, usec


def run_breakdown(client: redis.Redis, url: str, prefix: str, rounds: int, slice_s: float) -> None:
    """Print wall, server and client-CPU microseconds per pair for a ladder of variants."""
    shape = SameShape(url, prefix, IDLE_LIMIT)
    ladder: list[tuple[str, Contender, int]] = [
        ("floor: 2x EVALSHA 'return 1', no arguments", Floor(client, prefix, IDLE_LIMIT), 2),
        ("  same, on a kept connection", HeldFloor(client, prefix, IDLE_LIMIT), 2),
        (
            f"FairSemaphore's {len(shape.calls)} calls & arguments, trivial scripts, kept conn.",
            shape,
            len(shape.calls),
        ),
        ("FairSemaphore.acquire + release", Redsem(client, prefix, IDLE_LIMIT), len(shape.calls)),
    ]
    timed = interleave({label: impl for label, impl, _ in ladder}, rounds, slice_s)
    server: dict[str, float] = {}
    for label, impl, calls_per_pair in ladder:  # server time: one slice each, not interleaved
        calls0, usec0 = _script_usec(client)
        pairs_per_second(impl, slice_s)
        calls1, usec1 = _script_usec(client)
        server[label] = (usec1 - usec0) / max(1.0, (calls1 - calls0) / calls_per_pair)
    shape.client.close()
    print()
    print("Where a FairSemaphore pair's time goes (median microseconds per acquire+release pair):")
    rows = [["variant", "wall us", "server us", "client CPU us"]]
    rows += [
        [
            label,
            f"{statistics.median(timed.wall[label]) * 1e6:.1f}",
            f"{server[label]:.1f}",
            f"{statistics.median(timed.cpu[label]) * 1e6:.1f}",
        ]
        for label, _, _ in ladder
    ]
    print_table(rows)
    print(
        "  server us = EVALSHA time inside the server (INFO commandstats; on a shared server\n"
        "  other clients' EVALSHA count too); client CPU us = this process's CPU time, send/recv\n"
        "  syscalls included. Wall minus both: waiting for the server process to be scheduled,\n"
        "  and the loopback hop."
    )


# -- contention ---------------------------------------------------------------------------------


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


# -- report ---------------------------------------------------------------------------------------


def print_table(rows: list[list[str]]) -> None:
    """Print rows as a left-aligned first column and right-aligned others."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        print("  " + " | ".join(cells))
        if n == 0:
            print("  " + "-+-".join("-" * w for w in widths))


def report(idle: IdleResult, contention: dict[str, ContentionResult]) -> None:
    """Print the one table: idle pairs/s and ratios, then what contention showed."""
    rows = [
        [
            "impl",
            "pairs/s",
            "x floor",
            "x redis Lock",
            "over-admissions",
            "skewed share",
            "grants/s 8 procs",
            "max held/limit",
        ]
    ]
    for impl in IMPLS:
        key = impl.idle_key or impl.key
        if key not in idle.rounds:
            continue
        cells = [
            impl.label,
            f"{idle.median(key):,.0f}",
            f"{idle.ratio(key, 'floor'):.2f}",
            f"{idle.ratio(key, 'redis-lock'):.2f}",
        ]
        c = contention.get(impl.key)
        if c is None:
            cells += ["-", "-", "-", "-"]
        else:
            cells += [
                f"{c.over} of {c.grants}",
                f"{c.skewed_share:.3f}",
                f"{c.grants_per_s:,.0f}",
                f"{c.max_seen}/{c.limit}",
            ]
        rows.append(cells)
    print_table(rows)
    for key, c in contention.items():
        for error in c.errors:
            print(f"  ! {BY_KEY[key].label}: {error}")


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
