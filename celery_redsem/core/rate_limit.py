"""A rate limiter on the server's clock: at most ``rate`` admissions per second per name, across
every process, with an explicit ``burst``. Usable without Celery::

    limiter = RateLimiter(redis.Redis(), "api:42", "100/m")
    result = limiter.attempt()
    if not result:
        time.sleep(result.retry_after)  # exactly until the next free slot

GCRA (the generic cell rate algorithm): one key holds the limiter's theoretical arrival time
(TAT), and each attempt is one script call (``gcra.lua``), one round trip, on the server's
clock only. An attempt is admitted, or refused with the exact wait until it may run. Under a
permit id an attempt may also *book* that slot: the next free one is then kept for the caller
(first to ask, first served), so a caller that waits for its ``retry_after`` and asks again is
admitted without racing anyone. With ``reserve`` the next free slot is kept even when it is free
now, and nobody is admitted: the caller takes it with a later attempt under that id, and the
admission (which the rate spaces, however late the caller comes) counts from then. A Celery
worker's main process reserves, its pool child takes the slot just before the task body starts.
Bookings and admissions are remembered per permit id for ``keep`` seconds after their slot,
which makes attempts idempotent (a retried call uses no second slot). Every key expires: an
idle limiter leaves nothing behind.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from celery_redsem.core.client import RedisClient, validate_client
from celery_redsem.core.errors import AcquireTimeout, ConfigurationError
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys
from celery_redsem.core.permit_ids import MAX_PERMIT_ID_LENGTH, new_permit_id
from celery_redsem.core.scripts import GCRA, RATE_STATE, as_text, run_script
from celery_redsem.core.validation import (
    MAX_SECONDS,
    SECONDS_OR_ZERO,
    count_rule,
    seconds_rule,
    validate_name,
    validate_prefix,
)

__all__ = [
    "DEFAULT_KEEP",
    "RateLimiter",
    "RateResult",
    "RateState",
    "parse_rate",
    "read_rate_state",
]

#: Seconds an admission or booking is remembered under its permit id after its slot.
DEFAULT_KEEP = 60.0
#: The fastest rate taken: one admission per server microsecond.
MAX_RATE = 1_000_000.0
_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}
_BURST = count_rule()
_TIMEOUT = seconds_rule(zero_ok=True, none_ok=True, inf_ok=True)
_RATE_EXPECTED = (
    "a rate such as '10/s', '100/m' or '1000/h', or a number of admissions per second, "
    f"> 0, at most {MAX_RATE:.0f}/s and at least one per {MAX_SECONDS:.0f}s"
)


def parse_rate(rate: object) -> float:
    """Admissions per second for ``rate`` in Celery's notation (``"10/s"``, ``"100/m"``,
    ``"1000/h"``; ``"5"`` is per second) or a number per second; else a ConfigurationError."""
    per_second: float | None = None
    if isinstance(rate, str):
        count, _, unit = rate.strip().partition("/")
        if unit.strip() in ("", *_PER):
            try:
                per_second = float(count) / _PER[unit.strip() or "s"]
            except ValueError:
                per_second = None
    elif isinstance(rate, int | float) and not isinstance(rate, bool):
        per_second = float(rate)
    if per_second is None or not (1 / MAX_SECONDS <= per_second <= MAX_RATE):
        raise ConfigurationError(f"rate must be {_RATE_EXPECTED}, got {rate!r}")
    return per_second


@dataclass(frozen=True)
class RateResult:
    """What one attempt got: admitted, or the seconds to wait (``retry_after``).

    ``booked``: the slot at ``retry_after`` is kept for the attempt's permit id, so asking
    again then under that id is admitted. True in a boolean context when admitted.
    """

    admitted: bool
    retry_after: float
    booked: bool = False

    def __bool__(self) -> bool:
        return self.admitted


@dataclass(frozen=True)
class RateState:
    """A snapshot of one rate limiter on the server's clock (``None``: no key, so idle)."""

    name: str
    now_us: int
    #: Admissions per second, as the last admission stored it.
    rate: float | None
    burst: int | None
    #: The theoretical arrival time (server microseconds); None when idle.
    tat_us: int | None
    #: Seconds from now until an attempt that books nothing would be admitted.
    next_free: float
    #: Slots booked ahead of now, and entries remembered (admitted ones too).
    booked: int
    remembered: int


class RateLimiter:
    """At most ``rate`` admissions per second for ``name``, at most ``burst`` of them at once.

    Args:
        client: a redis-py client (``decode_responses`` either way) or cluster client.
        name: the limiter's name (the key's hash tag; the same rules as a semaphore name).
        rate: ``"10/s"``, ``"100/m"``, ``"1000/h"`` or admissions per second as a number.
        burst: admissions allowed at once after an idle spell (default 1: one at a time,
            spaced by ``1 / rate``). In any window of ``w`` seconds at most
            ``burst + w * rate`` are admitted.
        prefix: the first part of every key.
        keep: seconds an admission or booking is remembered under its permit id after its
            slot (attempts under that id within it use no second slot).
    """

    def __init__(
        self,
        client: RedisClient,
        name: str,
        rate: str | float,
        *,
        burst: int = 1,
        prefix: str = DEFAULT_PREFIX,
        keep: float = DEFAULT_KEEP,
    ) -> None:
        self.client = validate_client(client)
        self.name = validate_name(name)
        self.rate = parse_rate(rate)
        self.burst: int = _BURST.check(burst, "burst", name=name)
        self.keep: float = SECONDS_OR_ZERO.check(keep, "keep", name=name)
        self.keys = SemaphoreKeys(validate_prefix(prefix), self.name)
        #: Microseconds between admissions (rounded up: never faster than ``rate``).
        self.interval_us = max(1, math.ceil(1_000_000 / self.rate - 1e-6))
        self._args = [self.interval_us, self.burst, math.ceil(self.keep * 1000)]

    def __repr__(self) -> str:
        return f"<RateLimiter {self.name!r} {self.rate:g}/s burst={self.burst}>"

    def attempt(
        self,
        permit_id: str | None = None,
        *,
        book: bool = False,
        reserve: bool = False,
        max_wait: float | None = None,
    ) -> RateResult:
        """One attempt, one round trip: admitted now, or how long until a slot is free.

        Under a ``permit_id`` the attempt is idempotent (see the module docstring), and with
        ``book`` a refused one keeps the next free slot for that id if it is at most
        ``max_wait`` seconds ahead (None: any). ``reserve`` keeps that slot even when it is
        free now and admits nobody: the result is booked, with ``retry_after`` 0 if the slot
        is due; an attempt under the id at its slot is admitted (spaced by the rate from the
        admission before it if late), and an id admitted before is admitted again.
        """
        if permit_id is not None and not (
            isinstance(permit_id, str) and 0 < len(permit_id) <= MAX_PERMIT_ID_LENGTH
        ):
            raise ConfigurationError(
                f"permit_id must be a str of 1 to {MAX_PERMIT_ID_LENGTH} characters, "
                f"got {permit_id!r:.80}",
                name=self.name,
            )
        if (book or reserve) and permit_id is None:
            what = "reserve" if reserve else "book"
            raise ConfigurationError(f"{what}=True needs a permit_id to keep the slot for")
        horizon = _TIMEOUT.check(max_wait, "max_wait", name=self.name)
        horizon_us = MAX_SECONDS * 1e6 if horizon is None else min(horizon, MAX_SECONDS) * 1e6
        admitted, wait_us, booked = run_script(
            GCRA,
            self.client,
            [self.keys.rate, self.keys.rate_line],
            [*self._args, 2 if reserve else int(book), math.floor(horizon_us), permit_id or ""],
            self.name,
        )
        return RateResult(bool(admitted), int(wait_us) / 1e6, bool(booked))

    def wait(self, timeout: float | None = None, *, permit_id: str | None = None) -> bool:
        """Block until admitted: book the next free slot and sleep until it (one or two round
        trips). False, with nothing booked, if that slot is more than ``timeout`` seconds away."""
        permit_id = permit_id or new_permit_id()
        result = self.attempt(permit_id, book=True, max_wait=timeout)
        while not result.admitted:
            if not result.booked:
                return False
            time.sleep(result.retry_after)
            result = self.attempt(permit_id, book=True, max_wait=timeout)
        return True

    def admit(self, timeout: float | None = None, *, permit_id: str | None = None) -> None:
        """:meth:`wait`, raising :class:`~celery_redsem.AcquireTimeout` instead of False."""
        if not self.wait(timeout, permit_id=permit_id):
            raise AcquireTimeout(
                f"no slot of rate limiter {self.name!r} ({self.rate:g}/s) within {timeout}s",
                name=self.name,
                permit_id=permit_id,
            )

    def state(self) -> RateState:
        """A snapshot of this limiter (see :func:`read_rate_state`)."""
        return read_rate_state(self.client, self.name, prefix=self.keys.prefix)


def read_rate_state(client: RedisClient, name: str, *, prefix: str = DEFAULT_PREFIX) -> RateState:
    """A snapshot of the rate limiter ``name`` without knowing its settings (the CLI uses it)."""
    keys = SemaphoreKeys(validate_prefix(prefix), validate_name(name))
    reply: list[Any] = run_script(RATE_STATE, client, [keys.rate, keys.rate_line], [], name)
    now, tat, interval, burst = (as_text(v) for v in reply[:4])
    now_us = int(float(now))
    tat_us = int(float(tat)) if tat else None
    interval_us = int(float(interval)) if interval else None
    bursts = int(float(burst)) if burst else None
    next_free = 0.0
    if tat_us is not None and interval_us is not None:
        next_free = max(0, tat_us - (max(bursts or 1, 1) - 1) * interval_us - now_us) / 1e6
    return RateState(
        name=name,
        now_us=now_us,
        rate=1e6 / interval_us if interval_us else None,
        burst=bursts,
        tat_us=tat_us if tat_us is not None and tat_us > now_us else None,
        next_free=next_free,
        booked=int(reply[4]),
        remembered=int(reply[5]),
    )
