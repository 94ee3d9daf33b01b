"""The ledger of a burst whose worker was stopped mid-way: what became of each task.

Pure arithmetic on what the bodies recorded (no Celery, no Redis), for the ``pools`` scenario
(:mod:`benchmarks.celery_e2e.stops`). A task's *runs* are its bodies' starts, each with the end
its body recorded, or none: a body that began and never ended was *cut* (the worker died under
it). The stop is a moment: the ``SIGTERM`` or ``SIGKILL`` sent to the only worker running; a
fresh worker finishes the line after that one has exited.

Each task falls in one category (:data:`CATEGORIES`):

* ``once``: one run, ended;
* ``rerun after cut``: a body cut by the stop, then one run that ended: what ``acks_late``
  promises after a ``SIGKILL`` (its message was never acknowledged);
* ``ack in flight``: two runs that ended, the first within :data:`ACK_WINDOW` before a
  ``SIGKILL``, the second after it: the first body ended, but its acknowledgement (sent after
  the body returns, ``acks_late``) may not have reached the broker when the worker died, and
  the broker rightly delivered the message again;
* ``cut, not run again``: a cut body, no other run: lost, unless the stop was a ``SIGKILL``
  and the task not ``acks_late`` (then the docs say it is lost with the worker);
* ``ran twice``: two or more runs that ended, otherwise: a defect;
* ``lost``: no run and no failure recorded: a defect;
* ``failed``: no run that ended, a failure recorded;
* ``unfinished``: a run begun after the stop that never ended (the run was cut short).

Separately, :func:`overlapping` counts tasks two of whose runs overlapped in time (copies at
once), and :func:`most_at_once` the most bodies that ran at once (cut ones up to the stop).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "ACK_WINDOW",
    "CATEGORIES",
    "Ledger",
    "Run",
    "build_ledger",
    "classify",
    "most_at_once",
    "overlapping",
]

#: A body that ended at most this long before a SIGKILL may have had its ack still in flight.
ACK_WINDOW = 1.0

#: Every category, in the order the ledger prints them.
CATEGORIES = (
    "once",
    "rerun after cut",
    "ack in flight",
    "cut, not run again",
    "ran twice",
    "lost",
    "failed",
    "unfinished",
)


@dataclass(frozen=True)
class Run:
    """One body of a task: when it started, and when it ended (None: it never did)."""

    start: float
    end: float | None = None


def classify(
    runs: list[Run],
    stop: float | None,
    *,
    killed: bool,
    acks_late: bool,
    failed: bool = False,
    window: float = ACK_WINDOW,
) -> str:
    """The category of a task with ``runs`` (any order); ``stop`` the moment of the signal (None:
    no stop), ``killed`` whether it was a SIGKILL."""
    del acks_late  # (the category does not depend on it; whether it is a defect does)
    ended = sorted((r for r in runs if r.end is not None), key=lambda r: r.start)
    cut = [r for r in runs if r.end is None]
    if not runs:
        return "failed" if failed else "lost"
    if any(stop is None or r.start >= stop for r in cut):
        return "unfinished"
    if not ended:
        return "failed" if failed else "cut, not run again"
    if len(ended) == 1:
        return "rerun after cut" if cut and cut[0].start <= ended[0].start else "once"
    first, second = ended[0], ended[1]
    assert first.end is not None
    if (
        len(ended) == 2
        and not cut
        and killed
        and stop is not None
        and stop - window <= first.end <= stop <= second.start
    ):
        return "ack in flight"
    return "ran twice"


def is_defect(category: str, *, killed: bool, acks_late: bool) -> bool:
    """Whether a task in ``category`` is a defect: a loss, a double, a run left unfinished; a
    cut body not run again is one unless a SIGKILL cut a task that is not ``acks_late``."""
    if category == "cut, not run again":
        return acks_late or not killed
    return category in ("ran twice", "lost", "unfinished")


def overlapping(runs: list[Run], stop: float | None) -> bool:
    """Whether two of ``runs`` overlapped in time (a cut run lasting until ``stop``)."""
    spans = sorted((r.start, _end(r, stop)) for r in runs)
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))


def most_at_once(runs: Iterable[Run], stop: float | None) -> int:
    """The most runs that were under way at one moment (a cut run lasting until ``stop``)."""
    events: list[tuple[float, int]] = []
    for r in runs:
        events += [(r.start, 1), (_end(r, stop), -1)]
    most = now = 0
    for _, step in sorted(events):  # (an end sorts before a start at the same moment)
        now += step
        most = max(most, now)
    return most


def _end(run: Run, stop: float | None) -> float:
    if run.end is not None:
        return run.end
    return run.start if stop is None else max(stop, run.start)


@dataclass
class Ledger:
    """Every task's category, and the counts."""

    categories: dict[str, str]  # task id -> category
    killed: bool
    acks_late: bool
    overlapping: list[str] = field(default_factory=list)  # ids with two runs at once
    most_at_once: int = 0
    ack_gaps: list[float] = field(default_factory=list)  # "ack in flight": stop - first end

    @property
    def counts(self) -> Counter[str]:
        return Counter(self.categories.values())

    def ids(self, category: str) -> list[str]:
        return sorted(i for i, c in self.categories.items() if c == category)

    @property
    def defects(self) -> int:
        flags = {"killed": self.killed, "acks_late": self.acks_late}
        return sum(n for c, n in self.counts.items() if is_defect(c, **flags))

    def line(self) -> str:
        """The non-zero counts, in :data:`CATEGORIES` order."""
        counts = self.counts
        return ", ".join(f"{c} {counts[c]}" for c in CATEGORIES if counts[c])


def build_ledger(
    ids: Iterable[str],
    starts: Iterable[Mapping[str, object]],
    ends: Iterable[Mapping[str, object]],
    stop: float | None,
    *,
    killed: bool,
    acks_late: bool,
    failed: Iterable[str] = (),
    window: float = ACK_WINDOW,
) -> Ledger:
    """The ledger of the tasks ``ids`` from the start records (``id``, ``start``) and the end
    records (``id``, ``start``, ``end``) their bodies left; an end matches the start it carries."""
    ended = {(str(e["id"]), float(str(e["start"]))): float(str(e["end"])) for e in ends}
    runs: dict[str, list[Run]] = {i: [] for i in ids}
    for s in starts:
        task, start = str(s["id"]), float(str(s["start"]))
        runs.setdefault(task, []).append(Run(start, ended.get((task, start))))
    failures = set(failed)
    flags = {"killed": killed, "acks_late": acks_late}
    categories = {
        task: classify(r, stop, failed=task in failures, window=window, **flags)
        for task, r in runs.items()
    }
    gaps = [
        stop - min(r.end for r in runs[t] if r.end is not None)
        for t, c in categories.items()
        if c == "ack in flight" and stop is not None
    ]
    return Ledger(
        categories,
        killed,
        acks_late,
        overlapping=sorted(t for t, r in runs.items() if overlapping(r, stop)),
        most_at_once=most_at_once((r for rs in runs.values() for r in rs), stop),
        ack_gaps=sorted(gaps),
    )
