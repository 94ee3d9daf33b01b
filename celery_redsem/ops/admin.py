"""Operator tools behind ``celery redsem``: find semaphores, look at them, force-release, purge.

Everything here finds keys with ``SCAN`` (never ``KEYS``), so it is safe on a busy production
server and works on Redis Cluster (redis-py scans every primary). Nothing here is needed by tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from celery_redsem.core.client import DEFAULT_IDLE_TTL, RedisClient
from celery_redsem.core.errors import REDIS_ERRORS, BackendError
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys, validate_name, validate_prefix
from celery_redsem.core.permits import SemaphoreState
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.core.state import read_state

__all__ = [
    "ForceRelease",
    "force_release",
    "iter_names",
    "purge",
    "state_to_dict",
    "states",
]

logger = logging.getLogger(__name__)

SCAN_COUNT = 500


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _scan(client: RedisClient, match: str) -> Iterator[str]:
    try:
        for key in client.scan_iter(match=match, count=SCAN_COUNT):
            yield _text(key)
    except REDIS_ERRORS as exc:
        raise BackendError(f"Redis failed while scanning {match!r}: {exc}") from exc


def iter_names(
    client: RedisClient, *, prefix: str = DEFAULT_PREFIX, pattern: str = "*"
) -> Iterator[str]:
    """Names of the semaphores under ``prefix`` whose name matches the glob ``pattern``.

    Unordered, each name once. A semaphore is found by its ``holders`` key, which outlives its other
    keys, so an idle semaphore is listed until its keys expire.
    """
    prefix = validate_prefix(prefix)
    seen: set[str] = set()
    for key in _scan(client, SemaphoreKeys.scan_pattern(prefix, pattern)):
        name = SemaphoreKeys.name_from_key(prefix, key)
        if name is not None and name not in seen:
            seen.add(name)
            yield name


def states(
    client: RedisClient,
    *,
    prefix: str = DEFAULT_PREFIX,
    pattern: str = "*",
    max_count: int | None = None,
) -> tuple[list[SemaphoreState], int]:
    """Snapshots of the matching semaphores, sorted by name, and how many matched in all.

    At most ``max_count`` snapshots are read (one round trip each); the count is of all matches.
    """
    names = sorted(iter_names(client, prefix=prefix, pattern=pattern))
    shown = names if max_count is None else names[:max_count]
    return [read_state(client, name, prefix=prefix) for name in shown], len(names)


def state_to_dict(state: SemaphoreState) -> dict[str, Any]:
    """A JSON-ready dict of a snapshot (times in server milliseconds)."""
    return asdict(state)


@dataclass(frozen=True)
class ForceRelease:
    """What a force release did: ``"holder"`` (a permit was freed), ``"waiter"`` (a place in
    line was given up) or ``"none"`` (the id had neither)."""

    name: str
    permit_id: str
    released: str
    token: int | None


def force_release(
    client: RedisClient,
    name: str,
    permit_id: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    idle_ttl: float | None = None,
    actor: str = "",
) -> ForceRelease:
    """Take the permit (or place in line) of ``permit_id`` away, whoever holds it, and log it.

    Meant for an operator whose holder is known to be gone; ``actor`` (who did it) goes into
    the log line. A holder that is in fact still running finds out at its next heartbeat, or
    at its release if that comes first: its permit is reported lost. Idempotent.
    """
    before = read_state(client, validate_name(name), prefix=prefix)
    holder = next((h for h in before.holders if h.permit_id == permit_id), None)
    sem = FairSemaphore(
        client,
        name,
        before.limit or 1,
        prefix=prefix,
        idle_ttl=DEFAULT_IDLE_TTL if idle_ttl is None else idle_ttl,
    )
    freed = sem.release(permit_id)
    if not freed:
        kind = "none"
    elif holder is not None:
        kind = "holder"
    else:
        kind = "waiter"
    result = ForceRelease(name, permit_id, kind, holder.token if holder else None)
    who = actor or "?"
    if kind == "holder":
        logger.warning(
            "force release by %s: freed the permit of %r in semaphore %r (token %s)",
            who,
            permit_id,
            name,
            result.token,
        )
    elif kind == "waiter":
        logger.warning(
            "force release by %s: removed %r from the waiting line of %r", who, permit_id, name
        )
    else:
        logger.info("force release by %s: %r had no permit of %r", who, permit_id, name)
    return result


def purge(client: RedisClient, *, prefix: str = DEFAULT_PREFIX, pattern: str = "*") -> int:
    """Delete every key of the matching semaphores (holders included); return how many semaphores.

    Holders that are still running lose their permits (their next heartbeat reports them lost),
    so this is for clearing a test server or state left by a bug, not for normal operation.
    Keys are deleted per semaphore, each group in one hash slot (safe on Redis Cluster).
    """
    prefix = validate_prefix(prefix)
    groups: dict[str, list[str]] = {}
    for key in _scan(client, f"{prefix}:{{{pattern}}}:*"):
        name = SemaphoreKeys.name_from_key(prefix, key)
        if name is not None:
            groups.setdefault(name, []).append(key)
    purged = 0
    try:
        for name, keys in sorted(groups.items()):
            # Every named key, not only those SCAN returned: a waiting line must never outlive
            # its holders hash (tickets would restart), and SCAN may miss keys added meanwhile.
            named = set(SemaphoreKeys(prefix, name).all)
            deleted = int(client.delete(*sorted(named.union(keys))))
            if deleted:
                purged += 1
                logger.warning("purge: deleted %d keys of semaphore %r", deleted, name)
    except REDIS_ERRORS as exc:
        raise BackendError(f"Redis failed while purging: {exc}") from exc
    return purged
