"""The budget scenarios of ``python -m benchmarks.rate`` (issue 41): runs sent at once on one key
through the same two prefork workers, each start admitted by a limiter of the key:

* ``cost``: ``@with_rate_limit("200/s", burst=20, cost=lambda units: units)``, each run taking
  1 to 20 units (a fixed pseudo-random draw);
* ``windows``: ``@with_rate_limit(["40/s", "300/m"])``: the first 300 or so at the pace of
  the first window, the rest at the minute's 5 a second.

Each admission is read from the limiter's own line (the server's clock). Per window of each
limit, the check is GCRA's bound: between any two admissions (both counted) the units are at
most ``burst + span x rate`` (so in any second of a ``/s`` window at most rate + burst, in any
minute of a ``/m`` window at most its count + burst). The pace: the last admission against the
ideal, the earliest any limiter could admit it, ``max over windows of (units - burst) / rate``
from the first send (target: at most 1.05 x).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from benchmarks.rate.app import COST_BURST, COST_RATE, WINDOWS
from celery_redsem.core.keys import SemaphoreKeys
from celery_redsem.core.permit_ids import run_permit_id
from celery_redsem.core.rate_spec import Window, make_windows

__all__ = ["PACE_TARGET", "SCENARIOS", "BudgetFigures", "run_budget"]

#: The last admission at most this x its ideal.
PACE_TARGET = 1.05


@dataclass(frozen=True)
class Scenario:
    """One budget scenario: its task, its limiter's windows and each run's units."""

    task: str
    windows: tuple[Window, ...]
    units: list[int]


SCENARIOS = {
    "cost": Scenario(
        "bench.cost",
        make_windows(COST_RATE, COST_BURST, where="bench.cost"),
        [random.Random(41).randint(1, COST_BURST) for _ in range(150)],
    ),
    "windows": Scenario(
        "bench.windows", make_windows(WINDOWS, None, where="bench.windows"), [1] * 400
    ),
}


@dataclass(frozen=True)
class BudgetFigures:
    """What one scenario got on one broker."""

    scenario: str
    sent: int
    runs: int
    units: int
    #: Per window: its text, the most units between two admissions over what it allows
    #: (<= 0: held), and the most units admitted in any one period of the window.
    windows: list[tuple[str, float, int]]
    took: float  # first send to the last admission, seconds
    ideal: float
    trips: int
    failed: int

    @property
    def held(self) -> bool:
        return all(excess <= 1e-6 for _, excess, _ in self.windows)


def _excess(taken: list[tuple[float, int]], window: Window) -> tuple[float, int]:
    """The most units between two admissions over ``burst + span x rate``, and the most
    admitted in any one period of ``window``."""
    worst, most = float("-inf"), 0
    for i, (start, _) in enumerate(taken):
        units = 0
        for at, cost in taken[i:]:
            units += cost
            worst = max(worst, units - window.burst - (at - start) * window.rate)
            if at - start < window.period:
                most = max(most, units)
    return worst, most


def run_budget(
    app: Celery, client: redis.Redis, prefix: str, name: str, timeout: float
) -> BudgetFigures:
    """Send scenario ``name``'s runs on a fresh key through the app's workers; its figures."""
    scenario = SCENARIOS[name]
    task = app.tasks[scenario.task]
    seconds, micros = client.time()
    sent_at = seconds + micros / 1e6
    args: Callable[[int, int], tuple[Any, ...]] = (
        (lambda n, units: ("k", n, units)) if name == "cost" else (lambda n, _: ("k", n))
    )
    results = [task.delay(*args(n, u)) for n, u in enumerate(scenario.units)]
    failed = 0
    for result in results:
        with contextlib.suppress(Exception):
            result.get(timeout=timeout, propagate=False)
        failed += result.state != "SUCCESS"
    line = SemaphoreKeys(prefix, f"{name}:k").rate_line
    entries: list[tuple[bytes, float]] = client.zrange(line, 0, -1, withscores=True)  # type: ignore[assignment]
    admitted = {member.decode(): -score / 1e6 for member, score in entries if score < 0}
    taken = sorted(
        (admitted[run_permit_id(r.id)], u)
        for r, u in zip(results, scenario.units, strict=True)
        if run_permit_id(r.id) in admitted
    )
    raw = client.lrange(f"{prefix}:starts:{name}:k", 0, -1)
    total = sum(scenario.units)
    return BudgetFigures(
        scenario=name,
        sent=len(results),
        runs=len(taken),
        units=sum(u for _, u in taken),
        windows=[(w.text, *_excess(taken, w)) for w in scenario.windows],
        took=(taken[-1][0] - sent_at) if taken else 0.0,
        ideal=max(max(0, total - w.burst) / w.rate for w in scenario.windows),
        trips=sum(int(v.split()[2]) for v in raw),
        failed=failed,
    )


def budget_lines(broker: str, figures: BudgetFigures) -> list[str]:
    """The table rows and the verdicts of one scenario's figures."""
    f = figures
    ratio = f.took / f.ideal if f.ideal > 0 else float("nan")
    lines = [
        f"{broker:6s}  {f.scenario:7s}  admitted {f.runs}/{f.sent}  units {f.units}  "
        f"took {f.took:.2f}s  ideal {f.ideal:.2f}s  x ideal {ratio:.3f}  trips {f.trips}  "
        f"failed {f.failed}"
    ]
    for text, excess, most in f.windows:
        lines.append(
            f"          window {text:>7s}: most units in one period {most}, "
            f"worst span {excess:+.2f} units against burst + span x rate"
        )
    checks = [
        ("units within burst + span x rate in every window", f.held),
        (f"last admission <= {PACE_TARGET} x ideal", ratio <= PACE_TARGET),
        ("every run admitted, none failed", not f.failed and f.runs == f.sent),
    ]
    lines += [f"  {'MET   ' if met else 'MISSED'} {f.scenario}: {what}" for what, met in checks]
    return lines
