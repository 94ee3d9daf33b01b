"""A rate limiter on the server's clock: at most ``rate`` units per second per name, across
every process, with an explicit ``burst``, over one window or several. Usable without Celery::

    limiter = RateLimiter(redis.Redis(), "api:42", "100/m")
    result = limiter.attempt()
    if not result:
        time.sleep(result.retry_after)  # exactly until the next free slot

    tokens = RateLimiter(redis.Redis(), "llm:42", ["90000/m", "2000000/d"], burst=[8000, 90000])
    tokens.admit(timeout=60, cost=estimate)  # takes `estimate` units from both windows
    tokens.charge(used - estimate)  # more used than estimated: later starts wait for it

GCRA (the generic cell rate algorithm) with a cost: one key holds the limiter's theoretical
arrival time (TAT) per window, a start of ``cost`` units moves it on by ``cost`` intervals, and
several windows (``"10/s"`` and ``"10000/d"``) are checked together and moved on only if every
one admits (a refusal consumes none). :meth:`RateLimiter.charge` moves every window on by units
known only after the fact, without a check, delaying later starts. Each attempt is one script
call (``gcra.lua``), one round trip, on the server's clock only. An attempt is admitted, or
refused with the exact wait until it may run. Under a permit id an attempt may also *book* that
slot: the next free one is then kept for the caller (first to ask, first served), so a caller
that waits for its ``retry_after`` and asks again is admitted without racing anyone. With
``reserve`` the next free slot is kept even when it is free now, and nobody is admitted: the
caller takes it with a later attempt under that id, and the admission (which the rate spaces,
however late the caller comes) counts from then. A Celery worker's main process reserves, its
pool child takes the slot just before the task body starts. Bookings and admissions are
remembered per permit id for ``keep`` seconds after their slot, which makes attempts idempotent
(a retried call uses no second slot). Every key expires: an idle limiter leaves nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_redsem.core.client import RedisClient, validate_client
from celery_redsem.core.errors import AcquireTimeout
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys
from celery_redsem.core.permit_ids import new_permit_id
from celery_redsem.core.rate_spec import (
    DEFAULT_KEEP,
    AttemptOptions,
    RateOptions,
    RateResult,
    RateSpec,
    RateState,
    parse_rate,
    pause_args,
    rate_keys,
    result_of,
    state_from_reply,
    within,
)
from celery_redsem.core.scripts import GCRA, PAUSE, RATE_STATE, run_script
from celery_redsem.core.validation import validate_name, validate_prefix

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_KEEP",
    "RateLimiter",
    "RateResult",
    "RateState",
    "parse_rate",
    "pause_rate_limiter",
    "read_rate_state",
]


class RateLimiter(RateSpec):
    """At most ``rate`` units per second for ``name``, at most ``burst`` of them at once; with
    several rates, all of them at once (see :class:`~celery_redsem.core.rate_spec.RateSpec`
    for ``name``, ``rate``, ``burst``, ``prefix`` and ``keep``).

    Args:
        client: a redis-py client (``decode_responses`` either way) or cluster client.
    """

    def __init__(
        self,
        client: RedisClient,
        name: str,
        rate: str | float | Sequence[str | float],
        **options: Unpack[RateOptions],
    ) -> None:
        self.client = validate_client(client)
        super().__init__(name, rate, **options)

    def attempt(
        self,
        permit_id: str | None = None,
        **options: Unpack[AttemptOptions],
    ) -> RateResult:
        """One attempt of ``cost`` units, one round trip: admitted now, or how long until a slot
        is free. A cost above the smallest burst raises a ConfigurationError at once.

        Under a ``permit_id`` the attempt is idempotent (see the module docstring), and with
        ``book`` a refused one keeps the next free slot for that id if it is at most
        ``max_wait`` seconds ahead (None: any). ``reserve`` keeps that slot even when it is
        free now and admits nobody: the result is booked, with ``retry_after`` 0 if the slot
        is due; an attempt under the id at its slot is admitted (spaced by the rate from the
        admission before it if late), and an id admitted before is admitted again.
        """
        args = self.attempt_args(permit_id, **options)
        return result_of(run_script(GCRA, self.client, self.script_keys(), args, self.name))

    def charge(self, units: int, *, charge_id: str | None = None) -> None:
        """Add ``units`` to every window's account without a check (a cost known only after
        the fact, such as tokens used): later starts wait for them. One round trip,
        idempotent per ``charge_id`` (default: a new one per call)."""
        args = self.charge_args(units, charge_id)
        run_script(GCRA, self.client, self.script_keys(), args, self.name)

    def wait(
        self, timeout: float | None = None, *, permit_id: str | None = None, cost: int = 1
    ) -> bool:
        """Block until admitted: book the next free slot and sleep until it (one or two round
        trips; a pause is slept through too). False, with nothing booked, if that slot (or the
        end of a pause) is more than ``timeout`` seconds away."""
        permit_id = permit_id or new_permit_id()
        result = self.attempt(permit_id, cost=cost, book=True, max_wait=timeout)
        while not result.admitted:
            if not (result.booked or (result.paused and within(result, timeout))):
                return False
            time.sleep(result.retry_after)
            result = self.attempt(permit_id, cost=cost, book=True, max_wait=timeout)
        return True

    def admit(
        self, timeout: float | None = None, *, permit_id: str | None = None, cost: int = 1
    ) -> None:
        """:meth:`wait`, raising :class:`~celery_redsem.AcquireTimeout` instead of False."""
        if not self.wait(timeout, permit_id=permit_id, cost=cost):
            raise AcquireTimeout(
                f"no slot of rate limiter {self.name!r} ({self.rate_text}) for {cost} units "
                f"within {timeout}s",
                name=self.name,
                permit_id=permit_id,
            )

    def state(self) -> RateState:
        """A snapshot of this limiter (see :func:`read_rate_state`)."""
        return read_rate_state(self.client, self.name, prefix=self.keys.prefix)

    def pause(self, seconds: float, *, forget: str | None = None) -> float:
        """Admit nobody for ``seconds`` (on every worker: a ``Retry-After`` from the API the
        limiter guards), one round trip; a longer pause already set stays. Returns the
        seconds the limiter stays paused. Attempts meanwhile are refused with
        :attr:`~celery_redsem.RateResult.paused` and told to wait until it ends. ``forget``:
        a permit id whose admission is forgotten (its next attempt takes a new unit)."""
        args = self.pause_args(seconds, forget)
        left = run_script(
            PAUSE, self.client, [self.keys.pause, self.keys.rate_line], args, self.name
        )
        return int(left) / 1000

    def resume(self) -> None:
        """End a pause now (nothing happens if there is none)."""
        self.pause(0)


def read_rate_state(client: RedisClient, name: str, *, prefix: str = DEFAULT_PREFIX) -> RateState:
    """A snapshot of the rate limiter ``name`` without knowing its settings (the CLI uses it)."""
    keys = SemaphoreKeys(validate_prefix(prefix), validate_name(name))
    reply: list[Any] = run_script(RATE_STATE, client, rate_keys(keys), [], name)
    return state_from_reply(name, reply)


def pause_rate_limiter(
    client: RedisClient, name: str, seconds: float, *, prefix: str = DEFAULT_PREFIX
) -> float:
    """Pause the rate limiter ``name`` for ``seconds`` (0: resume it) without knowing its
    settings (the CLI uses it); the seconds it stays paused."""
    keys = SemaphoreKeys(validate_prefix(prefix), validate_name(name))
    return int(run_script(PAUSE, client, [keys.pause], pause_args(name, seconds), name)) / 1000
