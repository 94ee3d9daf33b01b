"""Key names: the one place that knows how a semaphore's keys are spelled.

All keys of one semaphore share the hash tag ``{name}``, so on Redis Cluster they live in one
slot and every script can touch them atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

from redis.cluster import RedisCluster

DEFAULT_PREFIX = "redsem"

__all__ = [
    "DEFAULT_PREFIX",
    "SemaphoreKeys",
    "declared_keys",
    "script_keys",
]


class _Key:
    """One key of a semaphore, ``<prefix>:{<name>}:<suffix>``; its docstring says what it holds."""

    def __init__(self, suffix: str, doc: str) -> None:
        self.suffix = suffix
        self.__doc__ = doc

    @overload
    def __get__(self, keys: None, owner: type[Any]) -> _Key: ...
    @overload
    def __get__(self, keys: SemaphoreKeys, owner: type[Any]) -> str: ...
    def __get__(self, keys: SemaphoreKeys | None, owner: type[Any]) -> _Key | str:
        return self if keys is None else f"{keys.base}:{self.suffix}"


@dataclass(frozen=True)
class SemaphoreKeys:
    """The Redis keys of one semaphore."""

    prefix: str
    name: str

    @property
    def base(self) -> str:
        """Common part of every key: ``<prefix>:{<name>}``."""
        return f"{self.prefix}:{{{self.name}}}"

    holders = _Key(
        "holders",
        """Hash: permit id -> ``<token>:<lease expiry ms>``, plus the semaphore's counters
        ``:fence``, ``:limit``, ``:ticket``, ``:queued``, ``:next``, ``:horizon`` and ``:gate``.""",
    )
    waiters = _Key("waiters", "Sorted set: permit id -> ticket (FIFO order of the waiting line).")
    waiter_expiry = _Key("wexp", "Sorted set: permit id -> waiter lease expiry (server ms).")
    waiter_due = _Key(
        "wdue", "Sorted set: permit id -> when the waiter said it would be back (server ms)."
    )
    dedupe = _Key(
        "dedupe", "Hash: the task run a de-duplicated name is marked for (:mod:`.marks`)."
    )
    wake_prefix = _Key(
        "wake:", "Prefix of the per-waiter wake-up lists (``<wake_prefix><permit id>``)."
    )
    fair = _Key(
        "fair",
        """Hash of a grouped semaphore (:mod:`.fair_share`): virtual time, tickets, its group
        limit, and the group of each holder and waiter (``_fair.lua`` has the full layout).""",
    )
    fair_queue = _Key(
        "fq", "Sorted set: group -> start tag of its head, groups that may be served."
    )
    fair_capped = _Key("fcap", "Sorted set: group -> start tag of its head, groups at their limit.")
    fair_grants = _Key("fh", "Sorted set: ``<group>\\0<permit id>`` of every grant of a group.")
    #: Prefixes of a grouped semaphore's keys per group (``<prefix><group>``): its line, its
    #: waiter leases, its waiters' due times, the channels its away waiters are told on, and
    #: its finish tag, weight and grants served.
    GROUP_KEY_KINDS = ("fw:", "fwx:", "fwd:", "fwn:", "fg:")

    def group_keys(self, group: str) -> list[str]:
        """The keys of one group of a grouped semaphore."""
        return [f"{self.base}:{kind}{group}" for kind in self.GROUP_KEY_KINDS]

    rate = _Key(
        "rate",
        """Hash of the rate limiter of this name: its theoretical arrival time (``tat``, server
        microseconds), ``interval`` and ``burst`` (see ``gcra.lua``).""",
    )
    rate_line = _Key(
        "rate:line", "Sorted set of the rate limiter: permit id -> its slot (server us)."
    )
    pause = _Key(
        "pause",
        """Hash: ``until`` when (server ms) the rate limiter of this name admits nobody; expires
        then (``pause.lua``).""",
    )

    def wake(self, permit_id: str) -> str:
        """The list a blocked waiter pops to be told that a permit may be free."""
        return self.wake_prefix + permit_id

    @property
    def all(self) -> list[str]:
        """Every key of the semaphore but the wake-up lists and a grouped one's keys per group
        (:meth:`group_keys`). The scripts are passed only
        ``holders`` and derive the others from it (same hash tag, same cluster slot)."""
        return [
            self.holders,
            self.waiters,
            self.waiter_expiry,
            self.waiter_due,
            self.fair,
            self.fair_queue,
            self.fair_capped,
            self.fair_grants,
        ]

    def is_group_key(self, key: str) -> bool:
        """Whether ``key`` is a key of one group of this (grouped) semaphore."""
        return any(key.startswith(f"{self.base}:{kind}") for kind in self.GROUP_KEY_KINDS)

    @classmethod
    def scan_pattern(cls, prefix: str, name_pattern: str = "*") -> str:
        """A SCAN pattern matching the ``holders`` key of every semaphore whose name matches.

        Every semaphore that holds or waits, or did within its idle TTL, has this key.
        """
        return f"{prefix}:{{{name_pattern}}}:holders"

    @classmethod
    def rate_scan_pattern(cls, prefix: str, name_pattern: str = "*", suffix: str = "rate") -> str:
        """A SCAN pattern matching the ``rate`` key (or the key ``suffix``, such as ``pause``)
        of every rate limiter whose name matches."""
        return f"{prefix}:{{{name_pattern}}}:{suffix}"

    @classmethod
    def name_from_key(cls, prefix: str, key: str) -> str | None:
        """The semaphore name inside one of its keys, or None if the key is not ours."""
        head = f"{prefix}:{{"
        if not key.startswith(head):
            return None
        # A name has no braces, so it ends at the first "}" (a permit id inside a wake-up
        # list's key may hold "}:" itself).
        end = key.find("}:", len(head))
        return key[len(head) : end] if end > len(head) else None


def script_keys(client: object, keys: SemaphoreKeys) -> list[str]:
    """The keys a script call declares: on one server only the holders hash (the scripts
    derive the others, which share its hash tag; fewer arguments, a shorter call on every task
    start and end); on Redis Cluster all four, so that while their slot migrates Redis
    redirects the call (``ASK``, ``TRYAGAIN``) instead of running it on half the keys."""
    return declared_keys(keys, cluster=isinstance(client, RedisCluster))


def declared_keys(keys: SemaphoreKeys, *, cluster: bool) -> list[str]:
    """:func:`script_keys` for a client that is a cluster (sync or asyncio) or is not."""
    if cluster:
        return [keys.holders, keys.waiters, keys.waiter_expiry, keys.waiter_due]
    return [keys.holders]
