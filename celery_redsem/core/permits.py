"""Value objects returned by the semaphore: a granted permit, a place in line, a snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys

__all__ = [
    "HolderInfo",
    "Permit",
    "RefreshResult",
    "SemaphoreState",
    "WaiterInfo",
    "Waiting",
]


class Permit(NamedTuple):
    """One grant of a semaphore. Immutable: a refresh returns a new ``Permit``.

    ``token`` is the fencing token: it strictly increases with every grant of the same
    semaphore name, so a storage system can reject writes from an older holder.
    ``expires_at`` is the lease expiry on the Redis server's clock, in milliseconds since the epoch.
    (A named tuple, not a dataclass: one is made on every task start, and a tuple is made for
    a third of the cost.)
    """

    id: str
    name: str
    token: int
    expires_at: int
    lease: float
    prefix: str = DEFAULT_PREFIX

    @property
    def keys(self) -> SemaphoreKeys:
        """The keys of the semaphore this permit belongs to."""
        return SemaphoreKeys(self.prefix, self.name)


@dataclass(frozen=True)
class Waiting:
    """Not granted: the caller's place in the waiting line (``position`` 1 is next).

    ``position`` is 0 when the caller asked only to try and did not join the line.
    ``expires_at`` is when the place is given up unless the caller comes back (server ms).
    ``paused`` is how many seconds the name stays paused (then ``position`` is 0): nothing is
    granted until then.
    """

    id: str
    name: str
    position: int
    expires_at: int
    paused: float = 0.0


@dataclass(frozen=True)
class RefreshResult:
    """Outcome of refreshing many permits: the renewed ones, the ones found lost, and (on Redis
    Cluster) the ones a node could not answer for, with its error: neither renewed nor known
    lost, so try again."""

    refreshed: list[Permit] = field(default_factory=list)
    lost: list[Permit] = field(default_factory=list)
    failed: list[Permit] = field(default_factory=list)
    error: Exception | None = None


@dataclass(frozen=True)
class HolderInfo:
    """A live holder in a :class:`SemaphoreState`."""

    permit_id: str
    token: int
    expires_at: int
    remaining_ms: int


@dataclass(frozen=True)
class WaiterInfo:
    """A live waiter in a :class:`SemaphoreState`, in line order."""

    permit_id: str
    ticket: int
    expires_at: int
    remaining_ms: int


@dataclass(frozen=True)
class SemaphoreState:
    """A consistent snapshot of one semaphore, taken on the server's clock."""

    name: str
    limit: int | None
    last_token: int | None
    now_ms: int
    holders: list[HolderInfo]
    waiters: list[WaiterInfo]
