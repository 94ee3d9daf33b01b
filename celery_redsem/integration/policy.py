"""When a task without a permit waits in its worker slot, and when it asks again if it does not.

A task at ``position`` in line behind ``limit`` holders whose bodies take ``hold`` seconds gets
a permit after about ``position * hold / limit`` seconds (each release moves the line by one).

* **Waiting in the slot** (:func:`head_wait_budget`). A contention retry costs far more than its
  countdown: Celery handles the ``Retry``, re-publishes the message, and the broker hands it
  back only after every message queued before it, often much later than the countdown. When the
  permit is a couple of holds away it is cheaper to wait for it in the slot, woken by the
  release. A task waits when it is within the next two rounds of permits
  (``position <= 2 * limit``) and its expected wait is within ``redsem_head_wait``; it gives up
  after twice its expected wait, or one and a half holds for each round of permits ahead of
  it if that is longer (holders that started together end together). Until a hold time has
  been seen, only a task within the next round (``position <= limit``) waits, for at most
  ``redsem_head_wait``.
* **The countdown** (:func:`contention_countdown`). Otherwise the task is retried with a
  countdown: the time until about ``position - limit`` holders have left, a little early; until
  a hold time has been seen, Celery's own exponential backoff (``get_exponential_backoff_interval``,
  in milliseconds so sub-second factors work).
* **When it is really back** (:class:`ReturnDelays`). How late retried tasks come back after
  their countdown (the broker's backlog, the worker's prefetch) is learnt per queue: a place in
  line holds a free permit for its task only from about when the task is really back, so a
  permit is not kept idle for a task still queued in the broker.

* **Parking** (:func:`park_time`, :func:`first_ask`, :func:`longest_park`). A task that
  admission parks in the worker's main process asks again about when the holders ahead of it
  have left, a little early, so a deep line costs it O(1) round trips (a release in the worker
  wakes the first parked task sooner); it stays parked at most :data:`MAX_PARKED` seconds from
  its delivery, and half the broker's ``visibility_timeout``.

Hold times and return delays are moving averages kept per process (bounded in size).
"""

from __future__ import annotations

import math
import os
import random
import threading
from collections import OrderedDict
from typing import Any

from celery.utils.time import get_exponential_backoff_interval

__all__ = [
    "DEFAULT_RETURN_DELAY",
    "EARLY",
    "FIRST_PARK",
    "HEAD_WAIT_ROUNDS",
    "MAX_PARK",
    "MAX_PARKED",
    "MAX_PARKED_TASKS",
    "MIN_PARK",
    "HoldTimes",
    "ReturnDelays",
    "contention_countdown",
    "error_countdown",
    "first_ask",
    "head_wait_budget",
    "hold_times",
    "longest_park",
    "park_time",
    "return_delays",
]

#: A task waits in its slot only within this many rounds of permits (``position <= n * limit``).
HEAD_WAIT_ROUNDS = 2
#: The shortest wait in the slot worth trying (holds of a few ms would give uselessly short ones).
MIN_HEAD_WAIT = 0.05
#: Seconds a retried task is assumed to come back after its countdown until one has been seen.
#: Too long is harmless (a task back before its place holds a permit just competes for a free
#: one); too short keeps permits idle for tasks still queued in the broker.
DEFAULT_RETURN_DELAY = 1.0


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


def error_countdown(
    *,
    attempt: int,
    backoff: float,
    backoff_max: float,
    jitter: bool,
    floor: float,
) -> float:
    """Seconds until a task retries after Redis failed: Celery's exponential backoff.

    ``attempt`` counts earlier retries after Redis errors (0 on the first). Within
    ``[floor, backoff_max]``.
    """
    ms = get_exponential_backoff_interval(
        _ms(backoff), attempt, _ms(backoff_max), full_jitter=jitter
    )
    return min(backoff_max, max(floor, ms / 1000))


def head_wait_budget(
    *, position: int, limit: int, hold_estimate: float | None, head_wait: float
) -> float:
    """Seconds a task at ``position`` should wait in its worker slot for a permit (0: retry now).

    See the module docstring. ``head_wait`` (``redsem_head_wait``) caps both the expected wait
    that is worth waiting for and the wait itself; 0 never waits.
    """
    if head_wait <= 0 or position < 1:
        return 0.0
    if hold_estimate is None:
        return head_wait if position <= limit else 0.0
    if position > HEAD_WAIT_ROUNDS * limit:
        return 0.0
    expected = position * hold_estimate / limit
    if expected > head_wait:
        return 0.0
    # Holders that started together end together: the turn may come a whole hold per round
    # of permits later than the steady pace says.
    waves = math.ceil(position / limit) * hold_estimate
    return min(head_wait, max(2 * expected, 1.5 * waves, MIN_HEAD_WAIT))


#: Bounds on how long a parked task waits before it asks again (the upper one while no hold
#: time of its task is known; after that, its turn as the line moves, up to its longest park).
MIN_PARK = 0.002
MAX_PARK = 1.0
#: Until a hold time of its task is known, a parked task asks again after this, doubling.
FIRST_PARK = 0.01
#: A parked task asks again a little before its turn is expected.
EARLY = 0.8
#: Seconds after its delivery a task may still be parked; then its child retries it through
#: the broker. (Well inside the brokers' own limits: Redis' default visibility timeout is an
#: hour, RabbitMQ's consumer timeout 30 minutes.)
MAX_PARKED = 300.0
#: At most this many tasks are parked per worker; more go to their pool child.
MAX_PARKED_TASKS = 10_000


def park_time(
    *, position: int, limit: int, hold: float | None, tries: int, longest: float = MAX_PARKED
) -> float:
    """Seconds a parked task at ``position`` waits before asking again (at most ``longest``).

    About when ``position`` holders of ``hold`` seconds have left a ``limit`` semaphore: a
    little early near the head of the line, a round of holders early further back; until a
    hold time is known, :data:`FIRST_PARK` doubling with each try, up to
    :data:`MAX_PARK`. A task woken by a release here asks sooner.
    """
    if hold is None:  # a round of holders at a time, doubling
        rounds = max(1, position // limit)
        return min(MAX_PARK, longest, rounds * FIRST_PARK * 2.0 ** min(tries, 32))
    # Near the head, a little before its turn; deeper, when about a round of holders is left
    # ahead of it (asking earlier only costs a round trip: releases here wake the first anyway).
    rounds_ahead = max(EARLY * position, position - limit)
    return min(longest, max(MIN_PARK, rounds_ahead * hold / limit))


def first_ask(
    present_lease: float,
    margin: float,
    *,
    limit: int,
    behind: int | None,
    hold: float | None,
    longest: float,
) -> tuple[float, float]:
    """The waiter lease and ``back_in`` of a task's first ask: present (``present_lease``,
    no ``back_in``), or, arriving behind tasks parked here on its semaphore (the last at place
    ``behind``), away for about as long as the one place after theirs waits, its place kept
    ``margin`` beyond: one call both asks and tells Redis when it will be back (until then its
    place holds no free permit for it)."""
    if behind is None:
        return present_lease, 0.0
    back_in = park_time(position=behind + 1, limit=limit, hold=hold, tries=0, longest=longest)
    return back_in + margin, back_in


def longest_park(conf: Any) -> float:
    """How long one delivery may stay parked (unacknowledged): :data:`MAX_PARKED`, and at most
    half the broker's ``visibility_timeout`` (Redis, SQS) in the app's ``conf``, after which
    the broker would deliver the message again and a second copy of the task would run."""
    options = conf.broker_transport_options or {}
    visibility = options.get("visibility_timeout")
    if isinstance(visibility, bool) or not isinstance(visibility, int | float):
        return MAX_PARKED
    return min(MAX_PARKED, visibility / 2) if visibility > 0 else MAX_PARKED


class _Averages:
    """Per-key moving averages (bounded: the least recently updated keys are forgotten)."""

    def __init__(self, *, weight: float, max_names: int) -> None:
        self._weight = weight
        self._max_names = max_names
        self._lock = threading.Lock()
        self._values: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _observe(self, key: str, value: float) -> None:
        with self._lock:
            old = self._values.pop(key, None)
            if old is None:
                new = (value, value / 2)
            else:
                mean, dev = old
                new = (
                    mean + self._weight * (value - mean),
                    dev + self._weight * (abs(value - mean) - dev),
                )
            self._values[key] = new
            while len(self._values) > self._max_names:
                self._values.popitem(last=False)

    def _get(self, key: str) -> tuple[float, float] | None:
        with self._lock:
            return self._values.get(key)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


class HoldTimes(_Averages):
    """Moving average of how long a task's body holds its permit, per task name, bounded."""

    def __init__(self, *, weight: float = 0.2, max_names: int = 1024) -> None:
        super().__init__(weight=weight, max_names=max_names)

    def observe(self, task_name: str, seconds: float) -> None:
        """Record one hold of ``seconds`` by ``task_name``."""
        self._observe(task_name, seconds)

    def estimate(self, task_name: str) -> float | None:
        """The average hold of ``task_name`` in this process, or None if never seen."""
        value = self._get(task_name)
        return None if value is None else value[0]


class ReturnDelays(_Averages):
    """How late contention retries come back after their countdown, per queue, bounded.

    The estimate is the moving average plus twice the moving mean deviation (as TCP estimates
    a retransmission timeout): an upper estimate, since a task back before its place holds a
    permit costs little, while a place that holds one for a task still away keeps it idle.
    """

    def __init__(self, *, weight: float = 0.25, max_names: int = 1024) -> None:
        super().__init__(weight=weight, max_names=max_names)

    def observe(self, queue: str, seconds: float) -> None:
        """Record that a retry through ``queue`` came back ``seconds`` after its countdown."""
        self._observe(queue, max(0.0, seconds))

    def estimate(self, queue: str) -> float:
        """Seconds a retry through ``queue`` is expected to come back late (a default if unseen)."""
        value = self._get(queue)
        if value is None:
            return DEFAULT_RETURN_DELAY
        mean, dev = value
        return mean + 2 * dev


#: Hold times seen by this process (a forked child starts with its parent's, which is fine:
#: they describe the same tasks).
hold_times = HoldTimes()
#: Return delays seen by this process, per queue.
return_delays = ReturnDelays()
for _averages in (hold_times, return_delays):
    os.register_at_fork(after_in_child=_averages._after_fork)
