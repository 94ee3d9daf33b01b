"""A snapshot of one semaphore (holders and waiters, and the groups of a grouped one) without
knowing its limit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from celery_redsem.core.client import RedisClient
from celery_redsem.core.fair_share import FAIR_STATE
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys, script_keys
from celery_redsem.core.permits import HolderInfo, SemaphoreState, WaiterInfo
from celery_redsem.core.scripts import STATE, as_text, run_script
from celery_redsem.core.validation import validate_name, validate_prefix

__all__ = ["GroupInfo", "groups_from_reply", "read_groups", "read_state", "state_from_reply"]


@dataclass(frozen=True)
class GroupInfo:
    """One group of a grouped semaphore: its live ``holders`` and ``waiting`` places, the
    ``weight`` its last caller gave (None if unknown), the grants it was ``served``, its
    ``share`` served (``served / weight``), and whether it is ``at_limit`` (``group_limit``)."""

    group: str
    holders: int
    waiting: int
    weight: float | None
    served: int
    share: float
    at_limit: bool


def read_state(client: RedisClient, name: str, *, prefix: str = DEFAULT_PREFIX) -> SemaphoreState:
    """Snapshot of the semaphore ``name`` without knowing its limit (the CLI uses this)."""
    keys = SemaphoreKeys(validate_prefix(prefix), validate_name(name))
    return state_from_reply(name, run_script(STATE, client, script_keys(client, keys), [], name))


def state_from_reply(name: str, reply: Any) -> SemaphoreState:
    """state.lua's reply for the semaphore ``name`` as a :class:`SemaphoreState`."""
    now, limit, fence, flat_holders, flat_waiters = reply
    now = int(now)
    return SemaphoreState(
        name=name,
        limit=int(limit) if limit else None,
        last_token=int(fence) if fence else None,
        now_ms=now,
        holders=[HolderInfo(pid, n, at, at - now) for pid, n, at in _triples(flat_holders)],
        waiters=[WaiterInfo(pid, n, at, at - now) for pid, n, at in _triples(flat_waiters)],
    )


def read_groups(client: RedisClient, name: str, *, prefix: str = DEFAULT_PREFIX) -> list[GroupInfo]:
    """The groups of the grouped semaphore ``name`` (one consistent snapshot): those waiting
    in the order they are served, then those that only hold. Empty for an ungrouped one."""
    keys = SemaphoreKeys(validate_prefix(prefix), validate_name(name))
    return groups_from_reply(run_script(FAIR_STATE, client, script_keys(client, keys), [], name))


def groups_from_reply(reply: Any) -> list[GroupInfo]:
    """fair_state.lua's reply as :class:`GroupInfo` values."""
    groups = []
    for group, holders, waiting, weight, served, _tag, at_limit in reply[1]:
        w = float(as_text(weight)) if weight else None
        groups.append(
            GroupInfo(
                group=as_text(group),
                holders=int(holders),
                waiting=int(waiting),
                weight=w,
                served=int(served),
                share=int(served) / w if w else float(served),
                at_limit=bool(int(at_limit)),
            )
        )
    return groups


def _triples(flat: list[Any]) -> Iterator[tuple[str, int, int]]:
    """state.lua's flat ``id, number, expiry ms, ...`` lists as typed triples."""
    for i in range(0, len(flat), 3):
        yield as_text(flat[i]), int(float(flat[i + 1])), int(float(flat[i + 2]))
