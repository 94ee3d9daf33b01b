"""The core benchmark's table: idle pairs/s and ratios, then what contention showed."""

from __future__ import annotations

from benchmarks.core.contenders import BY_KEY, IMPLS
from benchmarks.core.contention import ContentionResult
from benchmarks.core.idle import IdleResult


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
