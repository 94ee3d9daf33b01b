"""Idle throughput: acquire + release pairs per second on an idle semaphore, the
implementations taking turns in batches (:func:`interleave`)."""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from benchmarks.core.contenders import BY_KEY, Contender

IDLE_LIMIT = 5
BATCH = 10


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
