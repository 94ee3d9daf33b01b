"""Where a guarded task keeps its guards: each decorator's wrapper of the task's ``run``
carries its guard (a semaphore's or a rate limit's) under :data:`GUARD_ATTR`."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["GUARD_ATTR", "guards_on"]

#: The attribute of a guarded function that holds its guard.
GUARD_ATTR = "__redsem_guard__"
#: Wrappers looked through at most, outermost first.
_MAX_DEPTH = 16

G = TypeVar("G")


def guards_on(task: object, kind: type[G]) -> list[G]:
    """The guards of class ``kind`` on ``task``'s ``run`` (outermost first), or none."""
    found: list[G] = []
    fn: object = getattr(task, "run", None)
    fn = getattr(fn, "__func__", fn)
    for _ in range(_MAX_DEPTH):
        if fn is None:
            break
        guard = getattr(fn, "__dict__", {}).get(GUARD_ATTR)
        if isinstance(guard, kind) and guard not in found:
            found.append(guard)
        fn = getattr(fn, "__wrapped__", None)
    return found
