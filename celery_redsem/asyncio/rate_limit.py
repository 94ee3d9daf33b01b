"""The rate limiter for ``redis.asyncio`` clients: :class:`celery_redsem.RateLimiter`'s
windows, costs, bookings and charges over the same script and keys, so sync and asyncio
callers of one name share one budget::

    limiter = RateLimiter(redis.asyncio.Redis(), "llm:42", "90000/m", burst=8000)
    await limiter.admit(timeout=60, cost=estimate)
    await limiter.charge(used - estimate)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_redsem.asyncio.client import AsyncRedisClient, CancelWatch, run_script, validate_client
from celery_redsem.core.errors import AcquireTimeout
from celery_redsem.core.permit_ids import new_permit_id
from celery_redsem.core.rate_spec import (
    AttemptOptions,
    RateOptions,
    RateResult,
    RateSpec,
    RateState,
    result_of,
    state_from_reply,
    within,
)
from celery_redsem.core.scripts import GCRA, PAUSE, RATE_STATE

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = ["RateLimiter"]


class RateLimiter(RateSpec):
    """:class:`celery_redsem.RateLimiter` for a ``redis.asyncio.Redis`` or
    ``redis.asyncio.cluster.RedisCluster`` client: the same arguments, awaited methods."""

    def __init__(
        self,
        client: AsyncRedisClient,
        name: str,
        rate: str | float | Sequence[str | float],
        **options: Unpack[RateOptions],
    ) -> None:
        self.client = validate_client(client)
        super().__init__(name, rate, **options)

    async def attempt(
        self,
        permit_id: str | None = None,
        **options: Unpack[AttemptOptions],
    ) -> RateResult:
        """One attempt of ``cost`` units (see :meth:`celery_redsem.RateLimiter.attempt`)."""
        args = self.attempt_args(permit_id, **options)
        return result_of(await self._run(GCRA, args))

    async def charge(self, units: int, *, charge_id: str | None = None) -> None:
        """Add ``units`` to every window without a check (see
        :meth:`celery_redsem.RateLimiter.charge`)."""
        await self._run(GCRA, self.charge_args(units, charge_id))

    async def wait(
        self, timeout: float | None = None, *, permit_id: str | None = None, cost: int = 1
    ) -> bool:
        """Book the next free slot and sleep until it; False, with nothing booked, if it is
        more than ``timeout`` seconds away (see :meth:`celery_redsem.RateLimiter.wait`)."""
        permit_id = permit_id or new_permit_id()
        cancel = CancelWatch()
        result = await self.attempt(permit_id, cost=cost, book=True, max_wait=timeout)
        cancel.check()
        while not result.admitted:
            if not (result.booked or (result.paused and within(result, timeout))):
                return False
            await asyncio.sleep(result.retry_after)
            result = await self.attempt(permit_id, cost=cost, book=True, max_wait=timeout)
            cancel.check()
        return True

    async def admit(
        self, timeout: float | None = None, *, permit_id: str | None = None, cost: int = 1
    ) -> None:
        """:meth:`wait`, raising :class:`~celery_redsem.AcquireTimeout` instead of False."""
        if not await self.wait(timeout, permit_id=permit_id, cost=cost):
            raise AcquireTimeout(
                f"no slot of rate limiter {self.name!r} ({self.rate_text}) for {cost} units "
                f"within {timeout}s",
                name=self.name,
                permit_id=permit_id,
            )

    async def state(self) -> RateState:
        """A snapshot of this limiter (as
        :func:`~celery_redsem.core.rate_limit.read_rate_state`)."""
        return state_from_reply(self.name, await self._run(RATE_STATE, []))

    async def pause(self, seconds: float, *, forget: str | None = None) -> float:
        """Admit nobody for ``seconds`` (see :meth:`celery_redsem.RateLimiter.pause`)."""
        keys, args = [self.keys.pause, self.keys.rate_line], self.pause_args(seconds, forget)
        return int(await run_script(PAUSE, self.client, keys, args, self.name)) / 1000

    async def resume(self) -> None:
        """End a pause now (nothing happens if there is none)."""
        await self.pause(0)

    async def _run(self, script: Any, args: list[Any]) -> Any:
        return await run_script(script, self.client, self.script_keys(), args, self.name)
