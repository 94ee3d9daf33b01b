"""How long a task parked by admission waits, and the register of parked tasks.

:func:`park_time` turns a place in line into the time the task asks again: about when the
holders ahead of it have left, a little early, so a deep line costs a task O(1) round trips
(a release here wakes the first parked task sooner). :class:`ParkedTasks` keeps the parked
requests by request and by semaphore name, so the wake-up after a release and the guess of a
newcomer's place look only at the tasks parked on that semaphore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "EARLY",
    "FIRST_PARK",
    "MAX_PARK",
    "MAX_PARKED",
    "MAX_PARKED_TASKS",
    "MIN_PARK",
    "Parked",
    "ParkedTasks",
    "park_time",
]

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


@dataclass
class Parked:
    """A request parked for its permit."""

    req: Any
    name: str
    position: int
    first_ms: int  # server ms when its wait began (-1: not waiting for a permit yet)
    tries: int
    connection: Any  # the consumer's broker connection when it was parked
    received_at: float  # monotonic time this delivery reached the worker
    timer: Any = None
    qos: Any = None  # the consumer's prefetch window it widened, if it did


class ParkedTasks:
    """The requests parked in one worker, by request and by semaphore name."""

    def __init__(self) -> None:
        self._by_req: dict[Any, Parked] = {}
        self._by_name: dict[str, dict[Any, Parked]] = {}

    def __len__(self) -> int:
        return len(self._by_req)

    def __contains__(self, req: object) -> bool:
        return req in self._by_req

    def get(self, req: Any) -> Parked | None:
        """How ``req`` is parked, or None."""
        return self._by_req.get(req)

    def add(self, parked: Parked) -> None:
        """Register ``parked`` (two deliveries of one task id are parked apart)."""
        self._by_req[parked.req] = parked
        self._by_name.setdefault(parked.name, {})[parked.req] = parked

    def remove(self, req: Any) -> Parked | None:
        """Forget ``req``, if it was parked; how it was."""
        parked = self._by_req.pop(req, None)
        if parked is not None:
            same_name = self._by_name.get(parked.name, {})
            same_name.pop(req, None)
            if not same_name:
                self._by_name.pop(parked.name, None)
        return parked

    def on(self, name: str) -> list[Parked]:
        """The tasks parked on semaphore ``name``."""
        return list(self._by_name.get(name, {}).values())

    def deepest_position(self, name: str) -> int | None:
        """The last place in line known of the tasks parked on ``name`` (None: none)."""
        parked = self._by_name.get(name)
        if not parked:
            return None
        return max(p.position for p in parked.values())
