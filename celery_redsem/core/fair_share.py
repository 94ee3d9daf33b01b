"""Fair share by group: the checks and script arguments of a grouped semaphore.

A semaphore built with ``grouped=True`` serves its waiters by group: a free permit goes to the
head of the group with the smallest served share (grants divided by weight) among the groups
with waiters, FIFO within a group, and a group that starts waiting is served at once (start-time
fair queueing; the scripts are ``fair_acquire.lua``, ``fair_release.lua``, ``fair_state.lua``,
with the helpers and key layout in ``_fair.lua``). ``group_limit`` caps the permits one group
holds, decided in the same call as the limit.
"""

from __future__ import annotations

import math
from typing import Any

from celery_redsem.core.errors import ConfigurationError
from celery_redsem.core.scripts import ACQUIRE, RELEASE, LuaScript
from celery_redsem.core.validation import count_rule

__all__ = [
    "FAIR_ACQUIRE",
    "FAIR_RELEASE",
    "FAIR_STATE",
    "GROUP_LIMIT",
    "MAX_GROUP_LENGTH",
    "MAX_WEIGHT",
    "FairShare",
]

FAIR_ACQUIRE = LuaScript("fair_acquire.lua")
FAIR_RELEASE = LuaScript("fair_release.lua")
FAIR_STATE = LuaScript("fair_state.lua")

#: The longest group name accepted (it is part of the group's keys).
MAX_GROUP_LENGTH = 256
#: The largest weight accepted (``_fair.lua``'s MAX_WEIGHT).
MAX_WEIGHT = 1_000_000
#: ``group_limit``: None (no cap per group) or a count.
GROUP_LIMIT = count_rule(none_ok=True)


class FairShare:
    """Whether a semaphore is grouped, its group limit, and the scripts and arguments that
    follow from that (one per semaphore object, checked once)."""

    def __init__(self, grouped: object, group_limit: object, *, name: str) -> None:
        # (``name`` is for the errors here; the checks of an attempt take the current one.)
        if not isinstance(grouped, bool):
            raise ConfigurationError(f"grouped must be a bool, got {grouped!r}", name=name)
        self.grouped = grouped
        self.group_limit: int | None = GROUP_LIMIT.check(group_limit, "group_limit", name=name)
        if self.group_limit is not None and not grouped:
            raise ConfigurationError(
                "group_limit applies to a grouped semaphore: pass grouped=True too", name=name
            )
        self.acquire_script: LuaScript = FAIR_ACQUIRE if grouped else ACQUIRE
        self.release_script: LuaScript = FAIR_RELEASE if grouped else RELEASE

    def group_arg(self, group: object, weight: object, name: str) -> str:
        """fair_acquire.lua's ARGV[2], ``<weight>:<group limit>|<group>``, for one attempt."""
        if not self.grouped:
            raise ConfigurationError(
                f"group={group!r} given to a semaphore that is not grouped: build it with "
                "grouped=True",
                name=name,
            )
        if not isinstance(group, str) or not group:
            raise ConfigurationError(
                f"a grouped semaphore needs a group (a non-empty str) per attempt, got {group!r}",
                name=name,
            )
        if "\0" in group:
            raise ConfigurationError(f"group {group!r} must not contain NUL", name=name)
        if len(group) > MAX_GROUP_LENGTH:
            raise ConfigurationError(
                f"group is {len(group)} characters long; the maximum is {MAX_GROUP_LENGTH}",
                name=name,
            )
        return f"{_weight(weight, name)!r}:{self.group_limit or 0}|{group}"

    def check_ungrouped(self, weight: object, name: str) -> None:
        """An attempt with no group: refused by a grouped semaphore; no weight without one."""
        if self.grouped:
            raise ConfigurationError(
                "a grouped semaphore needs a group (a non-empty str) per attempt, got None",
                name=name,
            )
        if weight != 1:
            raise ConfigurationError(f"weight={weight!r} applies only with a group", name=name)


def _weight(weight: Any, name: str) -> float:
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or not 0 < weight <= MAX_WEIGHT
    ):
        raise ConfigurationError(
            f"weight must be a number > 0 and <= {MAX_WEIGHT}, got {weight!r}", name=name
        )
    return float(weight)
