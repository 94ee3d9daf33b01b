"""A snapshot of one semaphore (holders and waiters) without knowing its limit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from celery_redsem.core.client import RedisClient
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys, script_keys
from celery_redsem.core.permits import HolderInfo, SemaphoreState, WaiterInfo
from celery_redsem.core.scripts import STATE, as_text, run_script
from celery_redsem.core.validation import validate_name, validate_prefix

__all__ = ["read_state", "state_from_reply"]


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


def _triples(flat: list[Any]) -> Iterator[tuple[str, int, int]]:
    """state.lua's flat ``id, number, expiry ms, ...`` lists as typed triples."""
    for i in range(0, len(flat), 3):
        yield as_text(flat[i]), int(float(flat[i + 1])), int(float(flat[i + 2]))
