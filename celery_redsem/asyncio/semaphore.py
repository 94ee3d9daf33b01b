"""The fair semaphore and the lock for ``redis.asyncio`` clients.

The same scripts, keys and semantics as :class:`celery_redsem.FairSemaphore`, so sync and
asyncio callers (a Celery task and an async view) share one limit and one FIFO line::

    sem = FairSemaphore(redis.asyncio.Redis(), "market:42", limit=5, lease=10)
    async with sem.hold(timeout=30, keep_alive=True) as permit:
        await call_market(fencing_token=permit.token)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING

from redis.asyncio.cluster import RedisCluster

from celery_redsem.asyncio.client import AsyncRedisClient, WakeWaiter, run_script, validate_client
from celery_redsem.asyncio.renewal import Renewal
from celery_redsem.core.errors import BackendError
from celery_redsem.core.fair_share import FAIR_STATE
from celery_redsem.core.keys import declared_keys
from celery_redsem.core.permits import (
    HolderInfo,
    Permit,
    SemaphoreState,
    WaiterInfo,
    Waiting,
)
from celery_redsem.core.refresh import refresh_args, renewed
from celery_redsem.core.scripts import PAUSE, REFRESH, STATE
from celery_redsem.core.semaphore_spec import AttemptOptions, CommonOptions, SemaphoreSpec, naming
from celery_redsem.core.state import GroupInfo, groups_from_reply, state_from_reply

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = ["FairSemaphore", "Lock"]


class FairSemaphore(SemaphoreSpec):
    """At most ``limit`` holders at once per ``name``: :class:`celery_redsem.FairSemaphore`
    for ``redis.asyncio`` clients, in the same line as its sync callers.

    Args:
        client: a ``redis.asyncio.Redis`` (also Sentinel's ``master_for``) or
            ``redis.asyncio.cluster.RedisCluster``.
        name, limit: as for the sync :class:`~celery_redsem.FairSemaphore`.
        options: ``lease``, ``waiter_lease``, ``idle_ttl``, ``prefix``, ``clock``,
            ``grouped``, ``group_limit``, with the sync semaphore's meaning and defaults
            (``min_replicas`` is sync only).

    A blocking wait sleeps on the same wake-up list a release (sync or asyncio) pushes to,
    over a connection of its own: it never holds one of the client's pool.
    """

    def __init__(
        self,
        client: AsyncRedisClient,
        name: str,
        limit: int,
        **options: Unpack[CommonOptions],
    ) -> None:
        self.client = validate_client(client)
        super().__init__(name, limit, **options)
        self._keys = declared_keys(self.keys, cluster=isinstance(self.client, RedisCluster))

    # -- acquiring -----------------------------------------------------------------------------

    async def attempt(
        self, permit_id: str | None = None, **options: Unpack[AttemptOptions]
    ) -> Permit | Waiting:
        """One try, one round trip: a :class:`~celery_redsem.Permit`, or where the caller
        stands in line. The options (``join_line``, ``waiter_lease``, ``back_in``, ``group``,
        ``weight``, ``notify``) are the sync :meth:`celery_redsem.FairSemaphore.attempt`'s."""
        pid = self._permit_id(permit_id)
        try:
            script, args = self._attempt_args(pid, **options)
            reply = await run_script(script, self.client, self._keys, [*args], self.name)
        except BackendError as exc:
            naming(exc, pid)
            raise
        return self._result(pid, reply)

    async def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        *,
        permit_id: str | None = None,
        group: str | None = None,
        weight: float = 1.0,
    ) -> Permit | None:
        """Take a permit; ``None`` if none could be had (as the sync
        :meth:`celery_redsem.FairSemaphore.acquire`, ``group`` and ``weight`` too).

        A blocking wait is woken by any release of the semaphore, sync or asyncio. If the call
        is cancelled, the permit id gives up whatever it was granted or its place in line: a
        grant whose reply the cancellation cut off is not kept for a lease.
        """
        permit, _ = await self._acquire(blocking, timeout, permit_id, group, weight)
        return permit

    async def _acquire(
        self,
        blocking: bool,
        timeout: float | None,
        permit_id: str | None,
        group: str | None = None,
        weight: float = 1.0,
    ) -> tuple[Permit | None, float]:
        """``acquire``, and when (clock time) the request that was granted was sent."""
        deadline = self._deadline(blocking, timeout)
        pid = self._permit_id(permit_id)
        waiter = WakeWaiter(self.client, self.name)
        cancel = waiter.cancel
        try:
            while True:
                sent = self._clock()
                result = await self.attempt(pid, join_line=blocking, group=group, weight=weight)
                cancel.check()  # (a grant the cancellation cut off is released below)
                if isinstance(result, Permit):
                    return result, sent
                wait = self._next_wait(deadline, result.paused) if blocking else None
                if wait is None:
                    if blocking:  # leave the line
                        await self.release(pid)
                    return None, sent
                await waiter.pop(self.keys.wake(pid), wait, pid)
                cancel.check()
        except BackendError as exc:
            naming(exc, pid)
            raise
        except asyncio.CancelledError:
            with suppress(BackendError):
                await asyncio.shield(self.release(pid))
            raise
        finally:
            await waiter.close()

    @asynccontextmanager
    async def hold(
        self,
        timeout: float | None = None,
        *,
        permit_id: str | None = None,
        keep_alive: bool = False,
        group: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[Permit]:
        """``async with``: block for a permit (raise :class:`~celery_redsem.AcquireTimeout`),
        release on exit (as the sync :meth:`celery_redsem.FairSemaphore.hold`).

        With ``keep_alive`` an asyncio task refreshes the lease every lease/3. A busy event
        loop can make it run late: if the permit was lost by the time the block ends (found
        lost by a renewal, or the last confirmed lease ended and the server says so), leaving
        the block raises :class:`~celery_redsem.PermitLost`, unless the block is already
        raising. A late renewal is logged (logger ``celery_redsem.asyncio.renewal``).

        The release on leaving is shielded: a cancellation of the caller that arrives then
        does not keep the permit for its lease.
        """
        try:
            permit, granted_at = await self._acquire(True, timeout, permit_id, group, weight)
        except BackendError as exc:
            if exc.permit_id is not None:
                with suppress(BackendError):
                    await self.release(exc.permit_id)
            raise
        if permit is None:
            raise self._timed_out(timeout, permit_id)
        renewal = None
        if keep_alive:
            renewal = Renewal(permit, self.refresh, granted_at=granted_at, clock=self._clock)
        try:
            yield permit
        finally:
            try:
                lost = renewal is not None and await renewal.stop()
            finally:  # shielded: a cancellation arriving now does not keep the permit
                released = await asyncio.shield(self.release(permit))
        if lost or not released:
            raise self._lost_in_block(permit, keep_alive)

    # -- keeping and giving back ---------------------------------------------------------------

    async def release(self, permit: Permit | str) -> bool:
        """Give a permit back (or leave the line); idempotent and owner-checked (as the sync
        :meth:`celery_redsem.FairSemaphore.release`). True if something was given up."""
        arg = self._release_arg(permit)
        script = self._release_script
        return int(await run_script(script, self.client, self._keys, [arg], self.name)) > 0

    async def refresh(self, permit: Permit, *, lease: float | None = None) -> Permit:
        """Extend a held permit's lease (by ``lease`` seconds from now if given, else by its
        own); raise :class:`~celery_redsem.PermitLost` if it is no longer held."""
        permit = self._to_refresh(permit, lease)
        args = [self._idle_ms, *refresh_args(permit)]
        reply = await run_script(REFRESH, self.client, [permit.keys.holders], args, self.name)
        fresh = renewed(permit, reply[0])
        if fresh is None:
            raise self._lost(permit)
        return fresh

    # -- looking -------------------------------------------------------------------------------

    async def pause(self, seconds: float) -> float:
        """Grant nothing for ``seconds`` (see :meth:`celery_redsem.FairSemaphore.pause`)."""
        keys, args = [self.keys.pause], self.pause_args(seconds)
        return int(await run_script(PAUSE, self.client, keys, args, self.name)) / 1000

    async def resume(self) -> None:
        """End a pause now (nothing happens if there is none)."""
        await self.pause(0)

    async def state(self) -> SemaphoreState:
        """A consistent snapshot: holders by lease expiry, waiters in line order."""
        return state_from_reply(
            self.name, await run_script(STATE, self.client, self._keys, [], self.name)
        )

    async def groups(self) -> list[GroupInfo]:
        """The groups of a grouped semaphore (as the sync
        :meth:`celery_redsem.FairSemaphore.groups`)."""
        reply = await run_script(FAIR_STATE, self.client, self._keys, [], self.name)
        return groups_from_reply(reply)

    async def holders(self) -> list[HolderInfo]:
        """Live holders, soonest expiry first."""
        return (await self.state()).holders

    async def waiters(self) -> list[WaiterInfo]:
        """Live waiters in the order they will be served."""
        return (await self.state()).waiters

    async def locked(self) -> bool:
        """True if any permit is held right now (a live holder, on the server's clock)."""
        return bool(await self.holders())


class Lock(FairSemaphore):
    """A fair, fenced, leased lock for ``redis.asyncio`` clients: a :class:`FairSemaphore`
    with limit 1, in the same line as the sync :class:`celery_redsem.Lock` of that name.

    Takes ``client``, ``name`` and FairSemaphore's keyword options.
    """

    def __init__(
        self, client: AsyncRedisClient, name: str, **options: Unpack[CommonOptions]
    ) -> None:
        super().__init__(client, name, 1, **options)
