"""What a scenario prints: its table (header and rows of batches) and its targets, each with
its figure and MET or MISSED."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.celery_e2e.harness import Batch
from benchmarks.cpu import compare_line


@dataclass(frozen=True)
class Target:
    """One acceptance figure: what it is, its value (None: n/a) and the bound it must keep."""

    name: str
    value: float | None
    bound: float
    at_most: bool = False
    digits: int = 2

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.bound if self.at_most else self.value >= self.bound

    def line(self) -> str:
        op = "<=" if self.at_most else ">="
        value = "n/a" if self.value is None else f"{self.value:.{self.digits}f}"
        if self.value is not None and not self.met and float(value) == self.bound:
            value = f"{self.value:.{self.digits + 1}f}"  # a miss that rounding would hide
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[self.met]
        return f"  {self.name + ' ' + op + ' ' + f'{self.bound:g}':<52}{value:>9}  {verdict}"


def print_targets(targets: list[Target]) -> bool:
    print("targets:")
    for target in targets:
        print(target.line())
    return all(t.met is not False for t in targets)


def rate(count: int, batch: Batch) -> float:
    return count / len(batch.records) if batch.records else float("nan")


def row(name: str, setup: str, batch: Batch, extra: list[str]) -> str:
    n = len(batch.records)
    cells = [setup, str(n), f"{batch.makespan:.2f}s", *extra]
    cells += [f"{batch.retries / n:.3f}", deliveries(batch), str(batch.over)]
    return f"{name:<14}" + "".join(f"{c:>12}" for c in cells)


def deliveries(batch: Batch) -> str:
    """Deliveries per task the workers counted ("?" if a worker did not report)."""
    n = len(batch.records)
    return "?" if batch.received is None else f"{batch.received / n:.2f}"


def header(name: str, columns: list[str]) -> None:
    line = f"{name:<14}" + "".join(f"{c:>12}" for c in columns)
    print(line)
    print("-" * len(line))


def print_cpu(guarded: list[Batch], plain: list[Batch]) -> None:
    """The CPU a guarded and a plain task cost, where it was measured (:mod:`benchmarks.cpu`)."""
    line = compare_line((b.cpu for b in guarded), (b.cpu for b in plain))
    if line is not None:
        print(line)
