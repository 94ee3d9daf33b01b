"""The fair counting semaphore and the lock, each operation one atomic script and one round trip.

Usable without Celery::

    sem = FairSemaphore(redis.Redis(), "market:42", limit=5, lease=10)
    with sem.hold(timeout=30) as permit:
        call_market(fencing_token=permit.token)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypedDict

from redis.exceptions import NoScriptError

from celery_redsem.core.client import (
    DEFAULT_IDLE_TTL,
    DEFAULT_LEASE,
    DEFAULT_REPLICA_TIMEOUT,
    RedisClient,
    blocking_wait_cap,
    pop_within,
    socket_timeout,
    to_ms,
    validate_client,
)
from celery_redsem.core.errors import (
    REDIS_ERRORS,
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    NotEnoughReplicas,
    PermitLost,
)
from celery_redsem.core.heartbeat import Heartbeat, HeldPermit, get_heartbeat
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys, validate_name, validate_prefix
from celery_redsem.core.lane import executor_for
from celery_redsem.core.permit_ids import MAX_PERMIT_ID_LENGTH, new_permit_id
from celery_redsem.core.permits import HolderInfo, Permit, SemaphoreState, WaiterInfo, Waiting
from celery_redsem.core.refresh import refresh_permits
from celery_redsem.core.replication import connected_replicas, forget_primary, run_acknowledged
from celery_redsem.core.scripts import (
    ACQUIRE,
    RELEASE,
    LuaScript,
    as_text,
    script_failed,
    script_keys,
)
from celery_redsem.core.state import read_state
from celery_redsem.core.validation import LIMIT, SECONDS, SECONDS_OR_ZERO, count_rule

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = ["FairSemaphore", "Lock", "SemaphoreOptions"]

_REPLICAS = count_rule(minimum=0)

RENEWED = ":renewed"  # acquire.lua marks a renewal with this suffix when asked to


def _back_in(back_in: object, waiter_lease: float) -> float:
    """``back_in`` in seconds if it is a duration (validation.py's rule) shorter than the
    waiter lease, else a ConfigurationError."""
    seconds: float = SECONDS_OR_ZERO.check(back_in, "back_in")
    if seconds >= waiter_lease:
        raise ConfigurationError(
            f"back_in ({seconds}s) must be shorter than the waiter lease ({waiter_lease}s), "
            "or the place in line lapses before the waiter is back"
        )
    return seconds


def _naming(exc: BackendError, permit_id: str) -> None:
    """Have ``exc`` carry ``permit_id`` if it names none yet."""
    if exc.permit_id is None:
        exc.permit_id = permit_id


def _validate_permit_id(permit_id: object) -> str:
    if not isinstance(permit_id, str) or not permit_id:
        raise ConfigurationError(f"permit_id must be a non-empty str, got {permit_id!r}")
    if permit_id.startswith(":"):
        raise ConfigurationError(f"permit_id must not start with ':' (reserved), got {permit_id!r}")
    if len(permit_id) > MAX_PERMIT_ID_LENGTH:
        raise ConfigurationError(f"permit_id longer than {MAX_PERMIT_ID_LENGTH} characters")
    return permit_id


class FairSemaphore:
    """At most ``limit`` holders at once per ``name``, across every process that uses the server.

    Waiters are served first come, first served; every grant carries a fencing token; leases are
    kept on the server's clock, so a crashed holder frees its permit when its lease ends.

    Args:
        client: a ``redis.Redis`` (also Sentinel's ``master_for``) or ``RedisCluster``.
        name: the semaphore's name; every key it uses carries it as the cluster hash tag.
        limit: how many holders at once (an int >= 1).
        lease: seconds a permit lives without a refresh.
        waiter_lease: seconds a place in the waiting line lives without the waiter coming back
            (default: ``lease``).
        idle_ttl: seconds the keys outlive the last lease in them; then an idle semaphore
            leaves nothing behind.
        prefix: first part of every key, to keep the plugin in its namespace.
        clock: monotonic clock for local deadlines (injectable for tests).
        min_replicas: a grant counts only once this many replicas acknowledged it (``WAIT``,
            sent with the acquire in one round trip); else it is released and the attempt is
            "not granted", or :class:`NotEnoughReplicas` is raised if the primary has fewer
            replicas connected. 0 (the default) skips ``WAIT``. Not consensus: see the docs.
        replica_timeout: seconds ``WAIT`` may block for the acknowledgements (keep it below
            the client's ``socket_timeout``).

    Bounds: every duration (here and ``attempt``'s ``waiter_lease`` and ``back_in``) is at most
    a year, :data:`~celery_redsem.core.validation.MAX_SECONDS`, and ``limit`` at most
    :data:`~celery_redsem.core.validation.MAX_COUNT` (a billion); larger values raise
    :class:`ConfigurationError` before anything is sent to Redis.
    """

    def __init__(
        self,
        client: RedisClient,
        name: str,
        limit: int,
        *,
        lease: float = DEFAULT_LEASE,
        waiter_lease: float | None = None,
        idle_ttl: float = DEFAULT_IDLE_TTL,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.monotonic,
        min_replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
    ) -> None:
        self.client = validate_client(client)
        self.name = validate_name(name)
        self.limit: int = LIMIT.check(limit, "limit", name=name)
        self.lease = SECONDS.check(lease, "lease")
        self.waiter_lease = SECONDS.check(
            self.lease if waiter_lease is None else waiter_lease, "waiter_lease"
        )
        self.idle_ttl = SECONDS.check(idle_ttl, "idle_ttl")
        self.keys = SemaphoreKeys(validate_prefix(prefix), self.name)
        self._clock = clock
        self._keys = script_keys(self.client, self.keys)
        # acquire and release go over the client's lane (lane.py), sparing a pool checkout.
        self._execute = executor_for(self.client)
        # EVALSHA's numkeys and keys, encoded once, not on every call.
        self._key_args = (str(len(self._keys)).encode(), *(k.encode() for k in self._keys))
        self._prefix = self.keys.prefix
        self._lease_ms = to_ms(self.lease)
        self._idle_ms = to_ms(self.idle_ttl)
        self.min_replicas: int = _REPLICAS.check(min_replicas, "min_replicas", name=name)
        self.replica_timeout = SECONDS.check(replica_timeout, "replica_timeout")
        if min_replicas and self.replica_timeout > blocking_wait_cap(self.client):
            raise ConfigurationError(
                f"replica_timeout={self.replica_timeout}s does not fit in the client's "
                f"socket_timeout={socket_timeout(self.client)}s (less a margin): WAIT blocks "
                "for up to replica_timeout, and a socket timeout would leave an unacknowledged "
                "grant held; shorten replica_timeout or lengthen socket_timeout",
                name=name,
            )
        # Settings that never change, formatted once (acquire runs on every task start); each
        # call appends the permit id.
        self._settings_try = self._settings(self.waiter_lease, join_line=False)
        self._settings_join = self._settings(self.waiter_lease, join_line=True)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} limit={self.limit} lease={self.lease}s>"

    # -- acquiring -----------------------------------------------------------------------------

    def attempt(
        self,
        permit_id: str | None = None,
        *,
        join_line: bool = False,
        waiter_lease: float | None = None,
        back_in: float = 0.0,
    ) -> Permit | Waiting:
        """One try, one round trip: a :class:`Permit`, or where the caller stands in line.

        With ``join_line`` the caller takes a place in the FIFO line (or keeps the one its
        ``permit_id`` already has) for ``waiter_lease`` seconds. Calling again with the same
        ``permit_id`` is idempotent: a holder gets its permit back with a renewed lease.

        ``back_in`` says when a caller that gets no permit will ask again (0: it waits now).
        Until then its place does not hold a free permit for it: a permit nobody due can use
        goes to whoever is present, in line order. From then on, until it comes back or its
        waiter lease ends, its place does hold one. It must be shorter than the waiter lease.

        A :class:`BackendError` carries the permit id (``exc.permit_id``, drawn before sending
        when none was given): the request may have been granted with its reply lost, and
        releasing that id frees the permit.
        """
        pid = new_permit_id() if permit_id is None else _validate_permit_id(permit_id)
        try:
            if waiter_lease is not None or back_in:
                lease = self.waiter_lease if waiter_lease is None else waiter_lease
                settings = self._settings(
                    SECONDS.check(lease, "waiter_lease"), join_line, _back_in(back_in, lease)
                )
            else:
                settings = self._settings_join if join_line else self._settings_try
            if self.min_replicas:
                return self._attempt_acknowledged(pid, [settings + pid])
            # Runs on every task start, so it sends EVALSHA itself (evalsha() adds two
            # calls); _retry handles NOSCRIPT and errors.
            try:
                reply = self._execute("EVALSHA", ACQUIRE.sha_bytes, *self._key_args, settings + pid)
            except REDIS_ERRORS as exc:
                reply = self._retry(ACQUIRE, exc, settings + pid)
        except BackendError as exc:
            _naming(exc, pid)
            raise
        return self._result(pid, reply)

    def _retry(self, script: LuaScript, exc: BaseException, *args: Any) -> Any:
        """After ``script`` failed with ``exc``: run it again once the server lost it
        (``NOSCRIPT`` after a restart or ``SCRIPT FLUSH``), else raise BackendError."""
        try:
            if not isinstance(exc, NoScriptError):
                raise exc
            return script.load_and_call(self.client, self._keys, args)
        except REDIS_ERRORS as error:
            raise script_failed(script, self.name, error) from error

    def _result(self, pid: str, reply: Any) -> Permit | Waiting:
        """Decode acquire.lua: ``"<token>:<expiry>"`` if granted, ``[position, expiry]`` if not."""
        if type(reply) is str:  # decode_responses=True
            reply = reply.encode()
        if type(reply) is bytes:
            token, _, expires_at = reply.partition(b":")
            return Permit(pid, self.name, int(token), int(expires_at), self.lease, self._prefix)
        position, expires_at = reply
        return Waiting(pid, self.name, int(position), int(expires_at))

    def _settings(self, waiter_lease: float, join_line: bool, back_in: float = 0.0) -> str:
        """acquire.lua's ARGV[1] up to the permit id: ``limit:lease:waiter lease:idle ttl:join:
        back in[:1]|`` (ms; with ``min_replicas``, ``:1`` asks to mark a renewal)."""
        join = 1 if join_line else 0
        back = math.ceil(back_in * 1000)
        mark = ":1" if self.min_replicas else ""
        return (
            f"{self.limit}:{self._lease_ms}:{to_ms(waiter_lease)}:{self._idle_ms}:{join}:{back}"
            f"{mark}|"
        )

    def _attempt_acknowledged(self, pid: str, args: list[Any]) -> Permit | Waiting:
        """``attempt`` with ``WAIT``: a grant not acknowledged by enough replicas is not used."""
        try:
            reply, acked = run_acknowledged(
                ACQUIRE,
                self.client,
                self._keys,
                args,
                replicas=self.min_replicas,
                timeout_ms=to_ms(self.replica_timeout),
            )
        except REDIS_ERRORS as exc:
            raise BackendError(
                f"Redis failed during acquire.lua + WAIT for {self.name!r}: {exc}", name=self.name
            ) from exc
        renewed = False
        if isinstance(reply, bytes | str):  # a grant
            text = as_text(reply)
            renewed = text.endswith(RENEWED)
            reply = text.removesuffix(RENEWED)
        permit = self._result(pid, reply)
        if isinstance(permit, Waiting) or acked >= self.min_replicas:
            return permit
        # Not acknowledged: not to be used. A new grant goes back; a renewal stays as it was
        # (its grant may be another run's, or one whose acknowledgement was never seen: a
        # retried call after a dropped connection renews its own first attempt).
        if not renewed:
            self.release(permit)
        try:
            connected = connected_replicas(self.client, self._keys[0])
        except REDIS_ERRORS as exc:
            raise BackendError(f"Redis failed during INFO: {exc}", name=self.name) from exc
        if connected < self.min_replicas:
            forget_primary(self.client)
            raise NotEnoughReplicas(
                f"{self.name!r} needs min_replicas={self.min_replicas} acknowledgements but the "
                f"primary has {connected} replica(s) connected; the grant was not used",
                name=self.name,
                permit_id=pid,
            )
        return Waiting(pid, self.name, 0, 0)

    def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        *,
        permit_id: str | None = None,
    ) -> Permit | None:
        """Take a permit. Returns ``None`` if none could be had.

        Non-blocking (the default) tries once and does not join the line. Blocking waits in the
        FIFO line, sleeping on a wake-up list that a release pushes to (bounded by the waiter
        lease, so a crashed holder's expiry is noticed too), for at most ``timeout`` seconds
        (``None``: no limit). A blocking caller that gives up leaves the line. A
        :class:`BackendError` carries the permit id, as in :meth:`attempt`.
        """
        if not blocking:
            if timeout is not None:
                raise ConfigurationError("timeout only applies to blocking=True", name=self.name)
            result = self.attempt(permit_id)
            return result if isinstance(result, Permit) else None
        if timeout is not None:
            timeout = float(timeout)
            if not timeout >= 0:
                raise ConfigurationError(
                    f"timeout must be >= 0 seconds, or None to wait without limit; got {timeout}",
                    name=self.name,
                )
        pid = new_permit_id() if permit_id is None else _validate_permit_id(permit_id)
        deadline = None if timeout is None else self._clock() + timeout
        try:
            while True:
                result = self.attempt(pid, join_line=True)
                if isinstance(result, Permit):
                    return result
                remaining = math.inf if deadline is None else deadline - self._clock()
                if remaining <= 0:
                    self.release(pid)
                    return None
                self._wait_for_wake(pid, min(remaining, self.waiter_lease / 3))
        except BackendError as exc:
            _naming(exc, pid)
            raise

    @contextmanager
    def hold(
        self,
        timeout: float | None = None,
        *,
        permit_id: str | None = None,
        keep_alive: bool = False,
    ) -> Iterator[Permit]:
        """Context manager: block for a permit (raise :class:`AcquireTimeout`), release on exit.

        Nothing renews the lease unless ``keep_alive`` is set: then the process's heartbeat
        thread (the one Celery tasks use) refreshes it every lease/3 while the block runs. If
        the permit was lost by the time the block ends (its lease ran out and another caller
        took or swept it, or an operator released it), leaving the block raises
        :class:`PermitLost`, unless the block is already raising. (A lease that ran out with
        nobody asking since is still given back, without an error.)

        If acquiring raises :class:`BackendError`, the permit id it carries is released (best
        effort) before the error propagates: a grant whose reply was lost is not kept a lease.
        """
        try:
            permit = self.acquire(blocking=True, timeout=timeout, permit_id=permit_id)
        except BackendError as exc:
            if exc.permit_id is not None:
                with suppress(BackendError):
                    self.release(exc.permit_id)
            raise
        if permit is None:
            raise AcquireTimeout(
                f"no permit of {self.name!r} (limit {self.limit}) within {timeout}s",
                name=self.name,
                permit_id=permit_id,
            )
        held = self._keep_alive(permit) if keep_alive else None
        released = False
        try:
            yield permit
        finally:
            if held is not None:
                held[0].untrack(held[1])  # before the release, so it is not reported lost
            released = self.release(permit)
        if not released or (held is not None and held[1].lost):
            raise PermitLost(
                f"permit {permit.id!r} of {self.name!r} was lost before the block ended (lease "
                f"{self.lease}s{'' if keep_alive else ' with no keep_alive'})",
                name=self.name,
                permit_id=permit.id,
            )

    def _keep_alive(self, permit: Permit) -> tuple[Heartbeat, HeldPermit]:
        """Have this process's heartbeat thread refresh ``permit`` until untracked."""
        heartbeat = get_heartbeat()
        held = HeldPermit(permit, self.client, idle_ttl=self.idle_ttl, task_name=repr(self))
        return heartbeat, heartbeat.track(held)

    def _wait_for_wake(self, permit_id: str, seconds: float) -> None:
        """Wait up to ``seconds`` for a release's wake-up, clear of the socket timeout."""
        try:
            pop_within(self.client, self.keys.wake(permit_id), seconds)
        except REDIS_ERRORS as exc:
            raise BackendError(
                f"Redis failed while waiting for {self.name!r}: {exc}",
                name=self.name,
                permit_id=permit_id,
            ) from exc

    # -- keeping and giving back ---------------------------------------------------------------

    def release(self, permit: Permit | str) -> bool:
        """Give a permit back (or leave the line). Idempotent and owner-checked.

        With a :class:`Permit`, only that grant is released (its fencing token must match).
        With a bare permit id, whatever grant or place in line the id has is given up; this is
        how a worker's main process frees a task's permit after the child died.
        Returns True if a permit or a place in line was given up.
        """
        if isinstance(permit, Permit):
            self._check_same_semaphore(permit)
            arg = f"{permit.token}:{permit.id}"
        else:
            arg = ":" + _validate_permit_id(permit)
        try:  # as in attempt(): EVALSHA sent over the lane, on every task end
            reply = self._execute("EVALSHA", RELEASE.sha_bytes, *self._key_args, arg)
        except REDIS_ERRORS as exc:
            reply = self._retry(RELEASE, exc, arg)
        return int(reply) > 0

    def refresh(self, permit: Permit) -> Permit:
        """Extend a held permit's lease; raise :class:`PermitLost` if it is no longer held."""
        self._check_same_semaphore(permit)
        result = refresh_permits(self.client, [permit], idle_ttl=self.idle_ttl)
        if result.lost:
            raise PermitLost(
                f"permit {permit.id!r} of {self.name!r} was lost (lease expired or released)",
                name=self.name,
                permit_id=permit.id,
            )
        return result.refreshed[0]

    def _check_same_semaphore(self, permit: Permit) -> None:
        if permit.name != self.name or permit.prefix != self._prefix:
            raise ConfigurationError(
                f"permit {permit.id!r} belongs to {permit.name!r}, not {self.name!r}",
                name=self.name,
            )

    # -- looking -------------------------------------------------------------------------------

    def state(self) -> SemaphoreState:
        """A consistent snapshot: holders by lease expiry, waiters in line order."""
        return read_state(self.client, self.name, prefix=self.keys.prefix)

    def holders(self) -> list[HolderInfo]:
        """Live holders, soonest expiry first."""
        return self.state().holders

    def waiters(self) -> list[WaiterInfo]:
        """Live waiters in the order they will be served."""
        return self.state().waiters


class SemaphoreOptions(TypedDict, total=False):
    """:class:`FairSemaphore`'s keyword options, for :class:`Lock` to take as they are (their
    defaults and meaning are FairSemaphore's; a test keeps the two lists equal)."""

    lease: float
    waiter_lease: float | None
    idle_ttl: float
    prefix: str
    clock: Callable[[], float]
    min_replicas: int
    replica_timeout: float


class Lock(FairSemaphore):
    """A fair, fenced, leased mutual-exclusion lock: a :class:`FairSemaphore` with limit 1.

    Takes ``client``, ``name`` and FairSemaphore's keyword options (:class:`SemaphoreOptions`).
    """

    def __init__(self, client: RedisClient, name: str, **options: Unpack[SemaphoreOptions]) -> None:
        super().__init__(client, name, 1, **options)
