"""Keeping a held permit alive from an asyncio task, and knowing when that failed.

A :class:`Renewal` refreshes its permit every lease/3. An event loop kept busy (a blocking call
in a coroutine) can make a renewal run late, past the lease: the permit may then have been
taken. That is never silent: a renewal that finds the permit lost logs it and marks it lost;
one that runs late logs a warning; and :meth:`Renewal.stop` asks the server once more when the
last confirmed lease may have ended, so the holder learns of a lapse on leaving its block.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from celery_redsem.asyncio.client import CancelWatch
from celery_redsem.core.errors import BackendError, PermitLost
from celery_redsem.core.permits import Permit

__all__ = ["Renewal"]

logger = logging.getLogger(__name__)


class Renewal:
    """Refresh ``permit`` with ``refresh`` every lease/3 until :meth:`stop`.

    ``granted_at`` is when the request that granted the permit was sent (``clock`` time): the
    lease is known to last at least until then plus the lease, as is each renewal's from the
    time its request was sent.
    """

    def __init__(
        self,
        permit: Permit,
        refresh: Callable[[Permit], Awaitable[Permit]],
        *,
        granted_at: float,
        clock: Callable[[], float],
    ) -> None:
        self.permit = permit
        self.lost = False
        self._refresh = refresh
        self._clock = clock
        self._valid_until = granted_at + permit.lease
        self._task = asyncio.create_task(self._run(), name=f"redsem renewal {permit.id}")

    async def _run(self) -> None:
        interval = self.permit.lease / 3
        due = self._clock() + interval
        cancel = CancelWatch()
        while True:
            await asyncio.sleep(max(0.0, due - self._clock()))
            if not await self.renew():
                return
            cancel.check()  # stopped while renewing
            due = self._clock() + interval

    async def renew(self) -> bool:
        """Refresh once; False once the permit is known lost. Transient errors are logged and
        retried at the next interval."""
        sent = self._clock()
        if sent > self._valid_until:
            logger.warning(
                "renewal of permit %r of %r ran %.3fs past its lease: the event loop was busy",
                self.permit.id,
                self.permit.name,
                sent - self._valid_until,
            )
        try:
            self.permit = await self._refresh(self.permit)
        except PermitLost:
            logger.error("permit %r of %r was lost while held", self.permit.id, self.permit.name)
            self.lost = True
            return False
        except BackendError as exc:
            logger.warning("renewal of permit %r failed: %s", self.permit.id, exc)
            return True
        self._valid_until = sent + self.permit.lease
        return True

    async def stop(self) -> bool:
        """Stop renewing. True if the permit was lost while held: found lost by a renewal, or,
        where the last confirmed lease may have ended, by one more refresh now."""
        self._task.cancel()
        await asyncio.wait([self._task])  # (a cancellation of the caller still propagates)
        if not self._task.cancelled():
            self._task.result()  # an unforeseen error of the task is raised, not dropped
        if not self.lost and self._clock() >= self._valid_until:
            await self.renew()
        return self.lost
