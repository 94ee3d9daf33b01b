"""Operator tools behind ``celery redsem``: find semaphores, look at them, force-release, purge.

Everything here finds keys with ``SCAN`` (never ``KEYS``), so it is safe on a busy production
server and works on Redis Cluster (redis-py scans every primary). Nothing here is needed by tasks.

Patterns are Redis globs (``*``, ``?``, ``[...]``, ``\\`` escapes) on semaphore names; pass
``glob_escape(name)`` to find one name exactly, whatever characters it has. A key is taken as
a semaphore's only if it is spelled exactly as :class:`SemaphoreKeys` spells it: a permit id
such as ``x}:holders`` (inside a wake-up list's key) never passes for a semaphore name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from celery_redsem.core.client import DEFAULT_IDLE_TTL, RedisClient
from celery_redsem.core.errors import REDIS_ERRORS, BackendError, ConfigurationError, RedsemError
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys
from celery_redsem.core.marks import CoalesceRecord
from celery_redsem.core.permits import SemaphoreState
from celery_redsem.core.rate_limit import RateState, read_rate_state
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.core.state import GroupInfo, read_groups, read_state
from celery_redsem.core.validation import validate_name, validate_prefix

__all__ = [
    "ForceRelease",
    "coalesce_state",
    "force_release",
    "glob_escape",
    "group_lines",
    "groups_of",
    "iter_names",
    "purge",
    "rate_states",
    "state_to_dict",
    "states",
]

logger = logging.getLogger(__name__)

SCAN_COUNT = 500
_GLOB_SPECIALS = re.compile(r"[\\*?\[\]]")

#: Called with a semaphore's name and the error that kept it out of a listing.
OnSkip = Callable[[str, Exception], None]


def glob_escape(text: str) -> str:
    """A SCAN pattern that matches exactly ``text`` (every glob character escaped)."""
    return _GLOB_SPECIALS.sub(lambda m: "\\" + m.group(0), text)


def _raw(key: str) -> bytes:
    """``key`` as the bytes Redis stores (undoing :func:`_scan`'s surrogates)."""
    return key.encode("utf-8", "surrogateescape")


def _scan(client: RedisClient, match: str) -> Iterator[str]:
    """Keys matching ``match``; a key that is not UTF-8 keeps its bytes as surrogates."""
    try:
        for key in client.scan_iter(match=match, count=SCAN_COUNT):
            yield key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else key
    except REDIS_ERRORS as exc:
        raise BackendError(f"Redis failed while scanning {match!r}: {exc}") from exc


def _scan_names(
    client: RedisClient, prefix: str, pattern: str, every_key: bool
) -> Iterator[tuple[str, str, bool]]:
    """``(name, key, fixed)`` for each key of a semaphore whose name matches ``pattern``: its
    ``holders`` key only, or (``every_key``) also its other keys, ``fixed`` for all but the
    wake-up lists and a grouped semaphore's keys per group. The name ends at the first ``}``
    (names have none), and a key counts only if it is one :class:`SemaphoreKeys` spells for
    that name."""
    prefix = validate_prefix(prefix)
    if "{" in pattern or "}" in pattern:
        raise ConfigurationError(f"pattern {pattern!r} must not contain '{{' or '}}'")
    glob = SemaphoreKeys(glob_escape(prefix), pattern)
    head = SemaphoreKeys(prefix, "").base[:-1]  # "<prefix>:{"
    for key in _scan(client, f"{glob.base}:*" if every_key else glob.holders):
        name, brace, _ = key[len(head) :].partition("}")
        if not (key.startswith(head) and brace and name):
            continue
        keys = SemaphoreKeys(prefix, name)
        if key == keys.holders or (every_key and key in keys.all):
            yield name, key, True
        elif every_key and (key.startswith(keys.wake_prefix) or keys.is_group_key(key)):
            yield name, key, False


def iter_names(
    client: RedisClient, *, prefix: str = DEFAULT_PREFIX, pattern: str = "*"
) -> Iterator[str]:
    """Names of the semaphores under ``prefix`` whose name matches the glob ``pattern``.

    Unordered, each name once. A semaphore is found by its ``holders`` key, which outlives its other
    keys, so an idle semaphore is listed until its keys expire.
    """
    seen: set[str] = set()
    for name, _key, _fixed in _scan_names(client, prefix, pattern, every_key=False):
        if name not in seen:
            seen.add(name)
            yield name


def states(
    client: RedisClient,
    *,
    prefix: str = DEFAULT_PREFIX,
    pattern: str = "*",
    max_count: int | None = None,
    on_skip: OnSkip | None = None,
) -> tuple[list[SemaphoreState], int]:
    """Snapshots of the matching semaphores, sorted by name, and how many matched in all.

    At most ``max_count`` snapshots are read (one round trip each); the count is of all matches.
    A semaphore that cannot be read (a name no call accepts, stored data the state script or
    its reader cannot take) is left out and passed to ``on_skip`` (default: a logged
    warning), so that one bad entry never hides the others; an outage still raises.
    """
    names = sorted(iter_names(client, prefix=prefix, pattern=pattern))
    shown = names if max_count is None else names[:max_count]
    found = []
    for name in shown:
        try:
            found.append(read_state(client, name, prefix=prefix))
        except (RedsemError, ValueError) as exc:  # UnicodeError is a ValueError
            if isinstance(exc, BackendError) and exc.transient:
                raise
            (on_skip or _log_skip)(name, exc)
    return found, len(names)


def rate_states(
    client: RedisClient, *, prefix: str = DEFAULT_PREFIX, pattern: str = "*"
) -> list[RateState]:
    """Snapshots of the rate limiters under ``prefix`` whose name matches, sorted by name (a
    limiter has a key while its next free time is ahead, or while it is paused, so an idle one
    is not listed)."""
    head = SemaphoreKeys(validate_prefix(prefix), "").base[:-1]  # "<prefix>:{"
    names = set()
    for suffix in ("rate", "pause"):
        glob = SemaphoreKeys.rate_scan_pattern(glob_escape(prefix), pattern, suffix)
        for key in _scan(client, glob):
            name = SemaphoreKeys.name_from_key(prefix, key)
            if (
                key.startswith(head)
                and name
                and key == f"{SemaphoreKeys(prefix, name).base}:{suffix}"
            ):
                names.add(name)
    return [read_rate_state(client, name, prefix=prefix) for name in sorted(names)]


def groups_of(
    client: RedisClient, found: list[SemaphoreState], *, prefix: str = DEFAULT_PREFIX
) -> dict[str, list[GroupInfo]]:
    """The groups of each grouped semaphore of ``found`` (holders, waiting, weight, share
    served; one read each), by name; an ungrouped semaphore has none."""
    return {s.name: read_groups(client, s.name, prefix=prefix) for s in found}


def _log_skip(name: str, exc: Exception) -> None:
    logger.warning("skipped semaphore %r: %s", name, exc)


def coalesce_state(
    client: RedisClient, name: str, *, prefix: str = DEFAULT_PREFIX
) -> dict[str, Any] | None:
    """The running and pending runs of ``name`` (``dedupe="coalesce"``; a ``dedupe=True``
    mark shows as its running run), or None if it has neither."""
    state = CoalesceRecord(client, name, prefix=prefix).state()
    if state.running is None and state.pending is None:
        return None
    return asdict(state)


def state_to_dict(state: SemaphoreState, groups: list[GroupInfo] | None = None) -> dict[str, Any]:
    """A JSON-ready dict of a snapshot (times in server milliseconds), with ``groups`` (a
    grouped semaphore's, :func:`groups_of`) under ``"groups"`` if given."""
    found = asdict(state)
    if groups is not None:
        found["groups"] = [asdict(g) for g in groups]
    return found


def group_lines(
    groups: list[GroupInfo], shown: Callable[[str], str], *, heading: bool = False
) -> list[str]:
    """A line of text per group of a grouped semaphore (none for an ungrouped one), the group
    name as ``shown`` prints it; with ``heading``, a line before them."""
    lines = [
        f"  group   {shown(g.group)}  holders {g.holders}  waiting {g.waiting}  "
        f"weight {'?' if g.weight is None else f'{g.weight:g}'}  served {g.served}  "
        f"share {g.share:g}{'  at its group limit' if g.at_limit else ''}"
        for g in groups
    ]
    if heading and lines:
        lines.insert(0, f"  groups ({len(groups)}, waiting ones in the order they are served)")
    return lines


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
    # A grouped semaphore's release script keeps the groups' books.
    grouped = bool(read_groups(client, name, prefix=prefix))
    sem = FairSemaphore(
        client,
        name,
        before.limit or 1,
        prefix=prefix,
        idle_ttl=DEFAULT_IDLE_TTL if idle_ttl is None else idle_ttl,
        grouped=grouped,
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
    groups: dict[str, set[str]] = {}
    wake_lists: list[tuple[str, str]] = []
    for name, key, fixed in _scan_names(client, prefix, pattern, every_key=True):
        if fixed:
            groups.setdefault(name, set()).add(key)
        else:  # a glob's ``*`` can match across a permit id's ``}``: only with its semaphore
            wake_lists.append((name, key))
    for name, key in wake_lists:
        if name in groups:
            groups[name].add(key)
    purged = 0
    try:
        for name, keys in sorted(groups.items()):
            # Every named key, not only those SCAN returned: a waiting line must never outlive
            # its holders hash (tickets would restart), and SCAN may miss keys added meanwhile.
            named = keys.union(SemaphoreKeys(prefix, name).all)
            deleted = int(client.delete(*sorted(_raw(key) for key in named)))
            if deleted:
                purged += 1
                logger.warning("purge: deleted %d keys of semaphore %r", deleted, name)
    except REDIS_ERRORS as exc:
        raise BackendError(f"Redis failed while purging: {exc}") from exc
    return purged
