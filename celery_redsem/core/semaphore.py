"""The fair counting semaphore and the lock, each operation one atomic script and one round trip.

Usable without Celery::

    sem = FairSemaphore(redis.Redis(), "market:42", limit=5, lease=10)
    with sem.hold(timeout=30) as permit:
        call_market(fencing_token=permit.token)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

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
    BackendError,
    ConfigurationError,
    NotEnoughReplicas,
)
from celery_redsem.core.heartbeat import Heartbeat, HeldPermit, get_heartbeat
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys, script_keys
from celery_redsem.core.lane import executor_for
from celery_redsem.core.permits import HolderInfo, Permit, SemaphoreState, WaiterInfo, Waiting
from celery_redsem.core.refresh import refresh_permits
from celery_redsem.core.replication import connected_replicas, forget_primary, run_acknowledged
from celery_redsem.core.scripts import (
    ACQUIRE,
    PAUSE,
    LuaScript,
    as_text,
    run_script,
    script_failed,
)
from celery_redsem.core.semaphore_spec import (
    AttemptOptions,
    CommonOptions,
    SemaphoreSpec,
    naming,
    validate_permit_id,
)
from celery_redsem.core.state import GroupInfo, read_groups, read_state
from celery_redsem.core.validation import SECONDS, count_rule, validate_name

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = ["FairSemaphore", "Lock", "SemaphoreOptions"]

_REPLICAS = count_rule(minimum=0)

RENEWED = ":renewed"  # acquire.lua marks a renewal with this suffix when asked to


class FairSemaphore(SemaphoreSpec):
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
        grouped: serve waiters by fair share across groups: every attempt names its
            ``group`` (and may give a ``weight``); see :mod:`~celery_redsem.core.fair_share`.
        group_limit: with ``grouped``, at most this many holders per group (None: no cap).
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
        grouped: bool = False,
        group_limit: int | None = None,
        min_replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
    ) -> None:
        self.client = validate_client(client)
        self.min_replicas: int = _REPLICAS.check(min_replicas, "min_replicas", name=name)
        super().__init__(
            name,
            limit,
            lease=lease,
            waiter_lease=waiter_lease,
            idle_ttl=idle_ttl,
            prefix=prefix,
            clock=clock,
            grouped=grouped,
            group_limit=group_limit,
            mark_renewals=self.min_replicas > 0,
        )
        self._use_keys()
        # acquire and release go over the client's lane (lane.py), sparing a pool checkout.
        self._execute = executor_for(self.client)
        self.replica_timeout = SECONDS.check(replica_timeout, "replica_timeout")
        if min_replicas and self.replica_timeout > blocking_wait_cap(self.client):
            raise ConfigurationError(
                f"replica_timeout={self.replica_timeout}s does not fit in the client's "
                f"socket_timeout={socket_timeout(self.client)}s (less a margin): WAIT blocks "
                "for up to replica_timeout, and a socket timeout would leave an unacknowledged "
                "grant held; shorten replica_timeout or lengthen socket_timeout",
                name=name,
            )

    def renamed(self, name: str) -> FairSemaphore:
        """The same semaphore settings under another ``name``: a copy that checks only the
        name (building one from scratch checks every setting again; a worker with many keys
        does this on every task)."""
        other = copy.copy(self)
        other.name = validate_name(name)
        other.keys = SemaphoreKeys(self._prefix, other.name)
        other._use_keys()
        return other

    def in_group(self, group: str, weight: float = 1.0) -> FairSemaphore:
        """This grouped semaphore as seen by one caller of ``group`` with ``weight``: a copy
        whose attempts (and ``acquire``/``hold``) that name no group take these. Both are
        checked here (:class:`ConfigurationError` if bad)."""
        self._fair.group_arg(group, weight, self.name)
        other = copy.copy(self)
        other.group, other.weight = group, float(weight)
        return other

    def _use_keys(self) -> None:
        """The keys the scripts are called with, for :attr:`keys`; and EVALSHA's numkeys and
        keys, encoded once, not on every call."""
        self._keys = script_keys(self.client, self.keys)
        self._key_args = (str(len(self._keys)).encode(), *(k.encode() for k in self._keys))

    # -- acquiring -----------------------------------------------------------------------------

    def attempt(
        self,
        permit_id: str | None = None,
        *,
        join_line: bool = False,
        waiter_lease: float | None = None,
        back_in: float = 0.0,
        group: str | None = None,
        weight: float = 1.0,
        notify: str | None = None,
    ) -> Permit | Waiting:
        """One try, one round trip: a :class:`Permit`, or where the caller stands in line.

        With ``join_line`` the caller takes a place in the FIFO line (or keeps the one its
        ``permit_id`` already has) for ``waiter_lease`` seconds. Calling again with the same
        ``permit_id`` is idempotent: a holder gets its permit back with a renewed lease.

        ``back_in`` says when a caller that gets no permit will ask again (0: it waits now).
        Until then its place does not hold a free permit for it: a permit nobody due can use
        goes to whoever is present, in line order. From then on, until it comes back or its
        waiter lease ends, its place does hold one. It must be shorter than the waiter lease.

        On a ``grouped`` semaphore every attempt names its ``group`` (a str), and the line is
        served by fair share: a free permit goes to the head of the group with the smallest
        share served (grants / ``weight``) among the groups with waiters (see
        :mod:`~celery_redsem.core.fair_share`). With ``back_in`` a grouped waiter is away as in
        the FIFO line: its group's next present waiter is served meanwhile, unless it gives a
        Pub/Sub channel to ``notify``: then, when a release finds its turn has come while it
        is away, its place is made present (it holds the free permit for it, for at most 2 s)
        and its permit id is published on that channel, so it can come for the permit at
        once (Celery's admission parks tasks this way: each release goes to the next task in
        fair order, wherever it is parked).

        A :class:`BackendError` carries the permit id (``exc.permit_id``, drawn before sending
        when none was given): the request may have been granted with its reply lost, and
        releasing that id frees the permit.
        """
        pid = self._permit_id(permit_id)
        try:
            arg = self._acquire_arg(pid, join_line, waiter_lease, back_in)
            script: LuaScript = ACQUIRE
            args: tuple[str, ...] = (arg,)
            if group is not None or self.grouped or weight != 1 or notify is not None:
                script, args = self._fair_args(arg, group, weight, notify)
            if self.min_replicas:
                return self._attempt_acknowledged(pid, [*args], script)
            # Runs on every task start, so it sends EVALSHA itself (evalsha() adds two
            # calls); _retry handles NOSCRIPT and errors.
            try:
                reply = self._execute("EVALSHA", script.sha_bytes, *self._key_args, *args)
            except REDIS_ERRORS as exc:
                reply = self._retry(script, exc, *args)
        except BackendError as exc:
            naming(exc, pid)
            raise
        return self._result(pid, reply)

    def attempt_command(self, permit_id: str, **options: Unpack[AttemptOptions]) -> tuple[Any, ...]:
        """The command :meth:`attempt` sends (EVALSHA of its script), for a caller that sends
        it its own way, such as an event loop that does not wait for the reply; decode the
        reply with :meth:`attempt_reply`, reload the script on ``NOSCRIPT`` with
        :meth:`load_scripts`. Not for ``min_replicas`` (whose ``WAIT`` goes with it)."""
        script, args = self._attempt_args(validate_permit_id(permit_id), **options)
        return ("EVALSHA", script.sha_bytes, *self._key_args, *args)

    def attempt_reply(self, permit_id: str, reply: Any) -> Permit | Waiting:
        """Decode the reply to :meth:`attempt_command`'s command for ``permit_id``."""
        return self._result(permit_id, reply)

    def load_scripts(self) -> None:
        """Load the acquire script into the server's script cache (after a ``NOSCRIPT`` reply)."""
        script = self._fair.acquire_script
        try:
            self.client.script_load(script.source)
        except REDIS_ERRORS as exc:
            raise script_failed(script, self.name, exc) from exc

    def _retry(self, script: LuaScript, exc: BaseException, *args: Any) -> Any:
        """After ``script`` failed with ``exc``: run it again once the server lost it
        (``NOSCRIPT`` after a restart or ``SCRIPT FLUSH``), else raise BackendError."""
        try:
            if not isinstance(exc, NoScriptError):
                raise exc
            return script.load_and_call(self.client, self._keys, args)
        except REDIS_ERRORS as error:
            raise script_failed(script, self.name, error) from error

    def _attempt_acknowledged(
        self, pid: str, args: list[Any], script: LuaScript = ACQUIRE
    ) -> Permit | Waiting:
        """``attempt`` with ``WAIT``: a grant not acknowledged by enough replicas is not used."""
        try:
            reply, acked = run_acknowledged(
                script,
                self.client,
                self._keys,
                args,
                replicas=self.min_replicas,
                timeout_ms=to_ms(self.replica_timeout),
            )
        except REDIS_ERRORS as exc:
            raise BackendError(
                f"Redis failed during {script.filename} + WAIT for {self.name!r}: {exc}",
                name=self.name,
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
        group: str | None = None,
        weight: float = 1.0,
    ) -> Permit | None:
        """Take a permit. Returns ``None`` if none could be had.

        Non-blocking (the default) tries once and does not join the line. Blocking waits in the
        FIFO line, sleeping on a wake-up list that a release pushes to (bounded by the waiter
        lease, so a crashed holder's expiry is noticed too), for at most ``timeout`` seconds
        (``None``: no limit). A blocking caller that gives up leaves the line. A
        :class:`BackendError` carries the permit id, as in :meth:`attempt`. ``group`` and
        ``weight`` are :meth:`attempt`'s.
        """
        deadline = self._deadline(blocking, timeout)
        if not blocking:
            result = self.attempt(permit_id, group=group, weight=weight)
            return result if isinstance(result, Permit) else None
        pid = self._permit_id(permit_id)
        try:
            while True:
                result = self.attempt(pid, join_line=True, group=group, weight=weight)
                if isinstance(result, Permit):
                    return result
                wait = self._next_wait(deadline, result.paused)
                if wait is None:
                    self.release(pid)
                    return None
                self._wait_for_wake(pid, wait)
        except BackendError as exc:
            naming(exc, pid)
            raise

    @contextmanager
    def hold(
        self,
        timeout: float | None = None,
        *,
        permit_id: str | None = None,
        keep_alive: bool = False,
        group: str | None = None,
        weight: float = 1.0,
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
            permit = self.acquire(
                blocking=True, timeout=timeout, permit_id=permit_id, group=group, weight=weight
            )
        except BackendError as exc:
            if exc.permit_id is not None:
                with suppress(BackendError):
                    self.release(exc.permit_id)
            raise
        if permit is None:
            raise self._timed_out(timeout, permit_id)
        held = self._keep_alive(permit) if keep_alive else None
        released = False
        try:
            yield permit
        finally:
            if held is not None:
                held[0].untrack(held[1])  # before the release, so it is not reported lost
            released = self.release(permit)
        if not released or (held is not None and held[1].lost):
            raise self._lost_in_block(permit, keep_alive)

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
        arg = self._release_arg(permit)
        try:  # as in attempt(): EVALSHA sent over the lane, on every task end
            reply = self._execute("EVALSHA", self._release_script.sha_bytes, *self._key_args, arg)
        except REDIS_ERRORS as exc:
            reply = self._retry(self._release_script, exc, arg)
        return int(reply) > 0

    def refresh(self, permit: Permit, *, lease: float | None = None) -> Permit:
        """Extend a held permit's lease (by ``lease`` seconds from now if given, else by its
        own); raise :class:`PermitLost` if it is no longer held. The returned permit carries
        the lease it was extended by, so refreshing it again keeps that lease."""
        permit = self._to_refresh(permit, lease)
        result = refresh_permits(self.client, [permit], idle_ttl=self.idle_ttl)
        if result.lost:
            raise self._lost(permit)
        return result.refreshed[0]

    # -- looking -------------------------------------------------------------------------------

    def pause(self, seconds: float) -> float:
        """Grant nothing for ``seconds`` (0: :meth:`resume`), one round trip; a longer pause
        already set stays. Holders keep (and renew) their permits, waiters their places; an
        attempt meanwhile gets a :class:`Waiting` whose ``paused`` says how long is left. The
        pause is the name's: it holds the rate limiter of this name too. Returns the seconds
        the name stays paused."""
        keys, args = [self.keys.pause], self.pause_args(seconds)
        return int(run_script(PAUSE, self.client, keys, args, self.name)) / 1000

    def resume(self) -> None:
        """End a pause now (nothing happens if there is none)."""
        self.pause(0)

    def state(self) -> SemaphoreState:
        """A consistent snapshot: holders by lease expiry, waiters in line order."""
        return read_state(self.client, self.name, prefix=self.keys.prefix)

    def groups(self) -> list[GroupInfo]:
        """The groups of a grouped semaphore (waiting ones in the order they are served):
        holders, waiters, weight and share served of each."""
        return read_groups(self.client, self.name, prefix=self.keys.prefix)

    def holders(self) -> list[HolderInfo]:
        """Live holders, soonest expiry first."""
        return self.state().holders

    def waiters(self) -> list[WaiterInfo]:
        """Live waiters in the order they will be served."""
        return self.state().waiters

    def locked(self) -> bool:
        """True if any permit is held right now (a live holder, on the server's clock)."""
        return bool(self.holders())


class SemaphoreOptions(CommonOptions, total=False):
    """:class:`FairSemaphore`'s keyword options, for :class:`Lock` to take as they are (their
    defaults and meaning are FairSemaphore's; a test keeps the two lists equal)."""

    min_replicas: int
    replica_timeout: float


class Lock(FairSemaphore):
    """A fair, fenced, leased mutual-exclusion lock: a :class:`FairSemaphore` with limit 1.

    Takes ``client``, ``name`` and FairSemaphore's keyword options (:class:`SemaphoreOptions`).
    """

    def __init__(self, client: RedisClient, name: str, **options: Unpack[SemaphoreOptions]) -> None:
        super().__init__(client, name, 1, **options)
