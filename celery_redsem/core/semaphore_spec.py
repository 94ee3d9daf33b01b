"""A semaphore apart from its client: what the sync and the asyncio semaphore share.

:class:`SemaphoreSpec` holds the checked settings of one semaphore and speaks the scripts'
language without doing any I/O: it builds acquire.lua's and release.lua's arguments, decodes
their replies, plans a blocking wait's rounds and words the errors. The sync
:class:`~celery_redsem.FairSemaphore` and :class:`celery_redsem.asyncio.FairSemaphore` are
subclasses that only send what it builds, so both kinds of caller stand in one line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from celery_redsem.core.client import DEFAULT_IDLE_TTL, DEFAULT_LEASE, to_ms
from celery_redsem.core.errors import AcquireTimeout, BackendError, ConfigurationError, PermitLost
from celery_redsem.core.fair_share import FairShare
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys
from celery_redsem.core.permit_ids import MAX_PERMIT_ID_LENGTH, new_permit_id
from celery_redsem.core.permits import Permit, Waiting
from celery_redsem.core.rate_spec import pause_args
from celery_redsem.core.scripts import LuaScript
from celery_redsem.core.validation import (
    LIMIT,
    SECONDS,
    SECONDS_OR_ZERO,
    validate_name,
    validate_prefix,
)

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = [
    "COMMON_DEFAULTS",
    "AttemptOptions",
    "CommonOptions",
    "SemaphoreSpec",
    "back_in_seconds",
    "naming",
    "validate_permit_id",
]


class CommonOptions(TypedDict, total=False):
    """The keyword options every semaphore takes, sync or asyncio (see
    :class:`~celery_redsem.FairSemaphore` for their meaning and defaults)."""

    lease: float
    waiter_lease: float | None
    idle_ttl: float
    prefix: str
    clock: Callable[[], float]
    grouped: bool
    group_limit: int | None


class AttemptOptions(TypedDict, total=False):
    """The keyword options of an attempt, sync or asyncio (see
    :meth:`celery_redsem.FairSemaphore.attempt`; a test keeps the lists equal)."""

    join_line: bool
    waiter_lease: float | None
    back_in: float
    group: str | None
    weight: float
    notify: str | None


#: The options' defaults, the same for the sync and the asyncio semaphore.
COMMON_DEFAULTS: CommonOptions = {
    "lease": DEFAULT_LEASE,
    "waiter_lease": None,
    "idle_ttl": DEFAULT_IDLE_TTL,
    "prefix": DEFAULT_PREFIX,
    "clock": time.monotonic,
    "grouped": False,
    "group_limit": None,
}


def validate_permit_id(permit_id: object) -> str:
    """``permit_id`` if it is a usable permit id, else a ConfigurationError."""
    if not isinstance(permit_id, str) or not permit_id:
        raise ConfigurationError(f"permit_id must be a non-empty str, got {permit_id!r}")
    if permit_id.startswith(":"):
        raise ConfigurationError(f"permit_id must not start with ':' (reserved), got {permit_id!r}")
    if len(permit_id) > MAX_PERMIT_ID_LENGTH:
        raise ConfigurationError(f"permit_id longer than {MAX_PERMIT_ID_LENGTH} characters")
    return permit_id


def back_in_seconds(back_in: object, waiter_lease: float) -> float:
    """``back_in`` in seconds if it is a duration (validation.py's rule) shorter than the
    waiter lease, else a ConfigurationError."""
    seconds: float = SECONDS_OR_ZERO.check(back_in, "back_in")
    if seconds >= waiter_lease:
        raise ConfigurationError(
            f"back_in ({seconds}s) must be shorter than the waiter lease ({waiter_lease}s), "
            "or the place in line lapses before the waiter is back"
        )
    return seconds


def naming(exc: BackendError, permit_id: str) -> None:
    """Have ``exc`` carry ``permit_id`` if it names none yet (the request may have been
    granted with its reply lost: releasing that id frees the permit)."""
    if exc.permit_id is None:
        exc.permit_id = permit_id


class SemaphoreSpec:
    """The checked settings of one semaphore and the scripts' arguments and replies for it.

    The options (:class:`CommonOptions`) have the defaults both semaphores use.
    ``mark_renewals`` asks acquire.lua to mark a grant that renewed one held before (used
    with ``min_replicas``).
    """

    def __init__(
        self,
        name: str,
        limit: int,
        *,
        mark_renewals: bool = False,
        **options: Unpack[CommonOptions],
    ) -> None:
        given: CommonOptions = {**COMMON_DEFAULTS, **options}
        self.name = validate_name(name)
        self.limit: int = LIMIT.check(limit, "limit", name=name)
        self.lease: float = SECONDS.check(given["lease"], "lease")
        waiter_lease = given["waiter_lease"]
        self.waiter_lease: float = SECONDS.check(
            self.lease if waiter_lease is None else waiter_lease, "waiter_lease"
        )
        self.idle_ttl: float = SECONDS.check(given["idle_ttl"], "idle_ttl")
        self.keys = SemaphoreKeys(validate_prefix(given["prefix"]), self.name)
        self._clock: Callable[[], float] = given["clock"]
        self._fair = FairShare(given["grouped"], given["group_limit"], name=self.name)
        self.grouped: bool = self._fair.grouped
        self.group_limit: int | None = self._fair.group_limit
        self._release_script: LuaScript = self._fair.release_script
        #: The group and weight of attempts that name none (see ``in_group``).
        self.group: str | None = None
        self.weight: float = 1.0
        self._prefix = self.keys.prefix
        self._lease_ms = to_ms(self.lease)
        self._idle_ms = to_ms(self.idle_ttl)
        self._mark = ":1" if mark_renewals else ""
        # Settings that never change, formatted once (acquire runs on every task start); each
        # call appends the permit id.
        self._settings_try = self._settings(self.waiter_lease, join_line=False)
        self._settings_join = self._settings(self.waiter_lease, join_line=True)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} limit={self.limit} lease={self.lease}s>"

    # -- acquire.lua ---------------------------------------------------------------------------

    def _settings(self, waiter_lease: float, join_line: bool, back_in: float = 0.0) -> str:
        """acquire.lua's ARGV[1] up to the permit id: ``limit:lease:waiter lease:idle ttl:join:
        back in[:1]|`` (ms; ``:1`` asks to mark a renewal)."""
        join = 1 if join_line else 0
        back = math.ceil(back_in * 1000)
        return (
            f"{self.limit}:{self._lease_ms}:{to_ms(waiter_lease)}:{self._idle_ms}:{join}:{back}"
            f"{self._mark}|"
        )

    def _acquire_arg(
        self,
        pid: str,
        join_line: bool = False,
        waiter_lease: float | None = None,
        back_in: float = 0.0,
    ) -> str:
        """acquire.lua's ARGV[1] for one attempt of ``pid`` (see ``attempt``)."""
        if waiter_lease is None and not back_in:
            return (self._settings_join if join_line else self._settings_try) + pid
        lease = self.waiter_lease if waiter_lease is None else waiter_lease
        lease = SECONDS.check(lease, "waiter_lease")
        return self._settings(lease, join_line, back_in_seconds(back_in, lease)) + pid

    def _attempt_args(
        self, pid: str, **options: Unpack[AttemptOptions]
    ) -> tuple[LuaScript, tuple[str, ...]]:
        """The script an attempt of ``pid`` runs and its ARGV: acquire.lua's without a group,
        fair_acquire.lua's with one (see ``attempt``)."""
        back_in = options.get("back_in", 0.0)
        join, lease = options.get("join_line", False), options.get("waiter_lease")
        arg = self._acquire_arg(pid, join, lease, back_in)
        group, weight = options.get("group"), options.get("weight", 1.0)
        return self._fair_args(arg, group, weight, options.get("notify"))

    def _fair_args(
        self, arg: str, group: str | None, weight: float, notify: str | None = None
    ) -> tuple[LuaScript, tuple[str, ...]]:
        """The script and ARGV for acquire.lua's ARGV[1] ``arg``, with or without a group (and
        the channel to ``notify``, grouped only)."""
        if group is None and self.group is not None:  # (a view made by in_group)
            group, weight = self.group, self.weight
        if group is None:
            self._fair.check_ungrouped(weight, self.name)
            if notify is not None:
                raise ConfigurationError(
                    f"notify={notify!r} needs a grouped semaphore ({self.name!r} is not)",
                    name=self.name,
                )
            return self._fair.acquire_script, (arg,)
        group_arg = self._fair.group_arg(group, weight, self.name)
        if notify is None:
            return self._fair.acquire_script, (arg, group_arg)
        if not isinstance(notify, str) or not 0 < len(notify) <= 512:
            raise ConfigurationError(
                f"notify must be a Pub/Sub channel name of 1 to 512 characters, got {notify!r}",
                name=self.name,
            )
        return self._fair.acquire_script, (arg, group_arg, notify)

    def _result(self, pid: str, reply: Any) -> Permit | Waiting:
        """Decode acquire.lua: ``"<token>:<expiry>"`` if granted, ``[position, expiry]`` if not
        (``[0, 0, pause ms]`` while the name is paused)."""
        if type(reply) is str:  # decode_responses=True
            reply = reply.encode()
        if type(reply) is bytes:
            token, _, expires_at = reply.partition(b":")
            return Permit(pid, self.name, int(token), int(expires_at), self.lease, self._prefix)
        if len(reply) > 2:
            return Waiting(pid, self.name, 0, 0, int(reply[2]) / 1000)
        position, expires_at = reply
        return Waiting(pid, self.name, int(position), int(expires_at))

    # -- release.lua and refresh.lua -----------------------------------------------------------

    def _release_arg(self, permit: Permit | str) -> str:
        """release.lua's ARGV[1]: that grant (token and id) of a Permit, or whatever an id has."""
        if isinstance(permit, Permit):
            self._check_same_semaphore(permit)
            return f"{permit.token}:{permit.id}"
        return ":" + validate_permit_id(permit)

    def _to_refresh(self, permit: Permit, lease: float | None) -> Permit:
        """``permit`` (of this semaphore), with ``lease`` as its lease if one is given."""
        self._check_same_semaphore(permit)
        if lease is None:
            return permit
        return permit._replace(lease=SECONDS.check(lease, "lease", name=self.name))

    def _check_same_semaphore(self, permit: Permit) -> None:
        if permit.name != self.name or permit.prefix != self._prefix:
            raise ConfigurationError(
                f"permit {permit.id!r} belongs to {permit.name!r}, not {self.name!r}",
                name=self.name,
            )

    # -- a blocking wait -----------------------------------------------------------------------

    def _permit_id(self, permit_id: str | None) -> str:
        """``permit_id`` checked, or a new one."""
        return new_permit_id() if permit_id is None else validate_permit_id(permit_id)

    def _deadline(self, blocking: bool, timeout: float | None) -> float | None:
        """When a blocking acquire gives up (monotonic clock; None: never). A timeout is
        refused without ``blocking`` and when it is not a number >= 0."""
        if not blocking:
            if timeout is not None:
                raise ConfigurationError("timeout only applies to blocking=True", name=self.name)
            return None
        if timeout is None:
            return None
        timeout = float(timeout)
        if not timeout >= 0:
            raise ConfigurationError(
                f"timeout must be >= 0 seconds, or None to wait without limit; got {timeout}",
                name=self.name,
            )
        return self._clock() + timeout

    def _next_wait(self, deadline: float | None, paused: float = 0.0) -> float | None:
        """Seconds to wait for a wake-up before the next attempt, or None: time is up. A round
        lasts at most a third of the waiter lease, so the place in line never lapses; while the
        name is paused (``paused`` seconds more), until the pause ends if that is sooner."""
        remaining = math.inf if deadline is None else deadline - self._clock()
        if remaining <= 0:
            return None
        return min(remaining, self.waiter_lease / 3, paused or math.inf)

    def pause_args(self, seconds: float) -> list[Any]:
        """The arguments of ``pause.lua`` for pausing this name ``seconds`` (0: resume)."""
        return pause_args(self.name, seconds)

    # -- errors --------------------------------------------------------------------------------

    def _timed_out(self, timeout: float | None, permit_id: str | None) -> AcquireTimeout:
        return AcquireTimeout(
            f"no permit of {self.name!r} (limit {self.limit}) within {timeout}s",
            name=self.name,
            permit_id=permit_id,
        )

    def _lost_in_block(self, permit: Permit, keep_alive: bool) -> PermitLost:
        return PermitLost(
            f"permit {permit.id!r} of {self.name!r} was lost before the block ended (lease "
            f"{self.lease}s{'' if keep_alive else ' with no keep_alive'})",
            name=self.name,
            permit_id=permit.id,
        )

    def _lost(self, permit: Permit) -> PermitLost:
        return PermitLost(
            f"permit {permit.id!r} of {self.name!r} was lost (lease expired or released)",
            name=self.name,
            permit_id=permit.id,
        )
