"""How long a task without a permit waits before it asks again.

A task at ``position`` in line behind ``limit`` holders reaches the head of the line after about
``(position - limit) / limit`` hold times; that, a little early, is its countdown. Coming back
early is cheap (the head of the line waits in its slot for a release, see ``redsem_head_wait``);
coming back late leaves a permit that is reserved for it idle, and coming back much too early
costs a retry. Until a hold time has been seen the countdown is Celery's own exponential
backoff (``get_exponential_backoff_interval``, in milliseconds so sub-second factors work).
Hold times are learnt per task name in each process (:class:`HoldTimes`).
"""

from __future__ import annotations

import math
import os
import random
import threading
from collections import OrderedDict

from celery.utils.time import get_exponential_backoff_interval

__all__ = ["HoldTimes", "contention_countdown", "hold_times"]


def _ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000))


def contention_countdown(
    *,
    attempt: int,
    position: int,
    limit: int,
    hold_estimate: float | None,
    backoff: float,
    backoff_max: float,
    jitter: bool,
    floor: float,
    rng: random.Random | None = None,
) -> float:
    """Seconds until a task at ``position`` (1 is next) in a line of a ``limit`` semaphore retries.

    ``attempt`` counts earlier contention retries (0 on the first). With a ``hold_estimate``
    (how long a holder typically keeps its permit) the countdown is the time until about
    ``position - limit`` holders have left, less up to 30 % jitter so the task is back a little
    early. Without one it is Celery's exponential backoff from ``backoff``. Always within
    ``[floor, backoff_max]``.
    """
    if hold_estimate is None:
        ms = get_exponential_backoff_interval(
            _ms(backoff), attempt, _ms(backoff_max), full_jitter=jitter
        )
        return min(backoff_max, max(floor, ms / 1000))
    turn = max(1, position - limit) / max(1, limit) * hold_estimate
    if jitter:
        turn *= (rng or random).uniform(0.7, 1.0)
    return min(backoff_max, max(floor, turn))


class HoldTimes:
    """Moving average of how long a task's body holds its permit, per task name, bounded."""

    def __init__(self, *, weight: float = 0.2, max_names: int = 1024) -> None:
        self._weight = weight
        self._max_names = max_names
        self._lock = threading.Lock()
        self._averages: OrderedDict[str, float] = OrderedDict()

    def observe(self, task_name: str, seconds: float) -> None:
        """Record one hold of ``seconds`` by ``task_name``."""
        with self._lock:
            old = self._averages.pop(task_name, None)
            new = seconds if old is None else old + self._weight * (seconds - old)
            self._averages[task_name] = new
            while len(self._averages) > self._max_names:
                self._averages.popitem(last=False)

    def estimate(self, task_name: str) -> float | None:
        """The average hold of ``task_name`` in this process, or None if never seen."""
        with self._lock:
            return self._averages.get(task_name)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


#: Hold times seen by this process (a forked child starts with its parent's, which is fine:
#: they describe the same tasks).
hold_times = HoldTimes()
os.register_at_fork(after_in_child=hold_times._after_fork)
