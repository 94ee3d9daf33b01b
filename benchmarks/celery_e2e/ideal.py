"""The ideal the Celery benchmark compares with, and percentiles: pure arithmetic on send times
(no Celery, no Redis), shared by the scenarios and the offline dump report."""

from __future__ import annotations

import heapq
from collections import Counter

__all__ = ["ideal_schedule", "percentile"]


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
