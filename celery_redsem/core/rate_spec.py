"""What a rate limiter is, apart from how it talks to Redis: its windows, what its script is
sent, and what its replies mean. The sync :class:`~celery_redsem.RateLimiter` and the asyncio
one (:mod:`celery_redsem.asyncio.rate_limit`) share it, so both send ``gcra.lua`` the same
arguments and read the same keys.

A limiter has one or more *windows* (``"10/s"``, ``"10000/d"``), each a GCRA schedule of its
own: ``rate`` units per second, ``burst`` units at once. A start takes ``cost`` units from every
window in one script call, or from none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from celery_redsem.core.errors import ConfigurationError
from celery_redsem.core.keys import DEFAULT_PREFIX, SemaphoreKeys
from celery_redsem.core.permit_ids import MAX_PERMIT_ID_LENGTH, new_permit_id
from celery_redsem.core.scripts import as_text
from celery_redsem.core.validation import (
    MAX_COUNT,
    MAX_SECONDS,
    SECONDS_OR_ZERO,
    count_rule,
    seconds_rule,
    validate_name,
    validate_prefix,
)

if TYPE_CHECKING:  # typing.Unpack is new in 3.11; only the type checker needs it
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_KEEP",
    "MAX_RATE",
    "MAX_WINDOWS",
    "AttemptOptions",
    "RateOptions",
    "RateResult",
    "RateSpec",
    "RateState",
    "Window",
    "WindowState",
    "charge_id_for",
    "make_windows",
    "parse_rate",
    "parse_window",
    "pause_args",
    "rate_keys",
    "result_of",
    "state_from_reply",
    "within",
]

#: The fastest rate taken: one unit per server microsecond.
MAX_RATE = 1_000_000.0
#: The most windows one limiter may have.
MAX_WINDOWS = 16
_PER = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_COUNT = count_rule()
_TIMEOUT = seconds_rule(zero_ok=True, none_ok=True, inf_ok=True)
_PAUSE = seconds_rule(zero_ok=True)
_RATE_EXPECTED = (
    "a rate such as '10/s', '100/m', '1000/h' or '10000/d', or a number of units per second, "
    f"> 0, at most {MAX_RATE:.0f}/s and at least one per {MAX_SECONDS:.0f}s"
)
#: What ``gcra.lua``'s mode argument says.
TRY, BOOK, RESERVE, CHARGE = 0, 1, 2, 3


@dataclass(frozen=True)
class Window:
    """One window of a limiter: ``count`` units per ``period`` seconds, ``burst`` at once."""

    text: str
    count: float
    period: float
    burst: int

    @property
    def rate(self) -> float:
        """Units per second."""
        return self.count / self.period

    @property
    def interval_us(self) -> int:
        """Microseconds per unit (rounded up: never faster than the rate)."""
        return max(1, math.ceil(1_000_000 / self.rate - 1e-6))


def parse_window(rate: object) -> tuple[float, float]:
    """``(count, period)`` for ``rate`` in Celery's notation (``"10/s"``, ``"100/m"``,
    ``"1000/h"``, and ``"10000/d"``; ``"5"`` is per second) or a number per second; else a
    ConfigurationError."""
    window: tuple[float, float] | None = None
    if isinstance(rate, str):
        count, _, unit = rate.strip().partition("/")
        if unit.strip() in ("", *_PER):
            try:
                window = (float(count), _PER[unit.strip() or "s"])
            except ValueError:
                window = None
    elif isinstance(rate, int | float) and not isinstance(rate, bool):
        window = (float(rate), 1.0)
    if window is None or not (1 / MAX_SECONDS <= window[0] / window[1] <= MAX_RATE):
        raise ConfigurationError(f"rate must be {_RATE_EXPECTED}, got {rate!r}")
    return window


def parse_rate(rate: object) -> float:
    """Units per second for ``rate`` (see :func:`parse_window`); else a ConfigurationError."""
    count, period = parse_window(rate)
    return count / period


def make_windows(rate: object, burst: object, *, where: str) -> tuple[Window, ...]:
    """The windows of ``rate`` (one rate, or a list of them) with their bursts: ``burst`` an
    int (for one rate, or the first of several), a list of ints (one a window), or None: 1 for
    the first window and, for each later one, its own count (a budget spent at the pace of the
    first). A ConfigurationError names ``where`` when one is wrong."""
    rates = list(rate) if isinstance(rate, list | tuple) else [rate]
    if not 1 <= len(rates) <= MAX_WINDOWS:
        raise ConfigurationError(f"{where}: give 1 to {MAX_WINDOWS} rates, got {len(rates)}")
    if isinstance(burst, list | tuple):
        if len(burst) != len(rates):
            raise ConfigurationError(
                f"{where}: burst has {len(burst)} entries for {len(rates)} rates"
            )
        bursts: list[object] = list(burst)
    else:
        bursts = [burst, *[None] * (len(rates) - 1)]
    windows = []
    for n, (text, size) in enumerate(zip(rates, bursts, strict=True)):
        try:
            count, period = parse_window(text)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None
        default = 1 if n == 0 else max(1, math.floor(count))
        checked = _COUNT.check(default if size is None else size, f"{where}: burst of {text!r}")
        shown = text.strip() if isinstance(text, str) else f"{count:g}/s"
        window = Window(shown, count, period, checked)
        if window.interval_us * window.burst > MAX_SECONDS * 1e6:
            raise ConfigurationError(
                f"{where}: burst {window.burst} of rate {text!r} spans more than "
                f"{MAX_SECONDS:.0f}s of the rate; give a smaller burst"
            )
        windows.append(window)
    return tuple(windows)


@dataclass(frozen=True)
class RateResult:
    """What one attempt got: admitted, or the seconds to wait (``retry_after``).

    ``booked``: the slot at ``retry_after`` is kept for the attempt's permit id, so asking
    again then under that id is admitted. True in a boolean context when admitted.
    """

    admitted: bool
    retry_after: float
    booked: bool = False
    #: Refused because the limiter is paused (``retry_after``: until the pause ends).
    paused: bool = False

    def __bool__(self) -> bool:
        return self.admitted


#: Seconds an admission or booking is remembered under its permit id after its slot.
DEFAULT_KEEP = 60.0


class RateOptions(TypedDict, total=False):
    """The keyword options of a rate limiter, sync or asyncio (see :class:`RateSpec`)."""

    burst: int | Sequence[int] | None
    prefix: str
    keep: float


class AttemptOptions(TypedDict, total=False):
    """The keyword options of an attempt, sync or asyncio (see
    :meth:`celery_redsem.RateLimiter.attempt`)."""

    cost: int
    book: bool
    reserve: bool
    max_wait: float | None


class RateSpec:
    """The settings of one rate limiter, checked, and the script arguments they make.

    Args:
        name: the limiter's name (the key's hash tag; the same rules as a semaphore name).
        rate: ``"10/s"``, ``"100/m"``, ``"1000/h"``, ``"10000/d"`` or units per second as a
            number; or a list of them, the windows all checked by one call.
        burst: units allowed at once after an idle spell, per window (see
            :func:`make_windows`; default 1 for the first window: one unit at a time, spaced
            by ``1 / rate``). In any window of ``w`` seconds at most ``burst + w * rate``
            units are admitted. The largest cost a start may take is the smallest burst.
        prefix: the first part of every key.
        keep: seconds an admission or booking is remembered under its permit id after its
            slot (attempts under that id within it use no second slot).
    """

    def __init__(
        self,
        name: str,
        rate: str | float | Sequence[str | float],
        **options: Unpack[RateOptions],
    ) -> None:
        self.name = validate_name(name)
        where = f"rate limiter {self.name!r}"
        self.windows = make_windows(rate, options.get("burst"), where=where)
        keep = options.get("keep", DEFAULT_KEEP)
        self.keep: float = SECONDS_OR_ZERO.check(keep, "keep", name=name)
        self.keys = SemaphoreKeys(validate_prefix(options.get("prefix", DEFAULT_PREFIX)), name)
        self._window_args = [len(self.windows)]
        for window in self.windows:
            self._window_args += [window.interval_us, window.burst]
        #: The largest cost one start may take: the smallest burst.
        self.max_cost = min(window.burst for window in self.windows)

    @property
    def rate(self) -> float:
        """Units per second of the first window."""
        return self.windows[0].rate

    @property
    def burst(self) -> int:
        """Units at once of the first window."""
        return self.windows[0].burst

    @property
    def interval_us(self) -> int:
        """Microseconds per unit of the first window."""
        return self.windows[0].interval_us

    @property
    def rate_text(self) -> str:
        """The windows as given (``"10/s + 10000/d"``)."""
        return " + ".join(w.text for w in self.windows)

    def __repr__(self) -> str:
        bursts = ",".join(str(w.burst) for w in self.windows)
        return f"<{type(self).__name__} {self.name!r} {self.rate_text} burst={bursts}>"

    def check_cost(self, cost: object, *, charge: bool = False) -> int:
        """``cost`` if a start (or, with ``charge``, a charge) may take it, else a
        ConfigurationError: a start above the smallest burst could never be admitted."""
        if charge:
            most = min(MAX_COUNT, math.floor(MAX_SECONDS * 1e6 / max(self._intervals())))
        else:
            most = self.max_cost
        if not (isinstance(cost, int) and not isinstance(cost, bool) and 1 <= cost <= most):
            what = "units charged" if charge else "cost"
            hint = (
                ""
                if charge or not isinstance(cost, int) or cost < 1
                else f": no start of more than burst {most} units can ever be admitted"
                " (raise the burst of every window to the largest cost)"
            )
            raise ConfigurationError(
                f"{what} of rate limiter {self.name!r} ({self.rate_text}) must be an int from "
                f"1 to {most}, got {cost!r}{hint}",
                name=self.name,
            )
        return cost

    def _intervals(self) -> list[int]:
        return [window.interval_us for window in self.windows]

    def attempt_args(self, permit_id: str | None, **options: Unpack[AttemptOptions]) -> list[Any]:
        """The arguments of ``gcra.lua`` for one attempt, checked."""
        mode = RESERVE if options.get("reserve") else BOOK if options.get("book") else TRY
        return self.script_args(permit_id, options.get("cost", 1), mode, options.get("max_wait"))

    def charge_args(self, units: int, charge_id: str | None) -> list[Any]:
        """The arguments of ``gcra.lua`` for a charge of ``units``, checked."""
        return self.script_args(charge_id_for(charge_id), units, CHARGE, None)

    def script_args(
        self, permit_id: str | None, cost: int, mode: int, max_wait: float | None
    ) -> list[Any]:
        """The arguments of ``gcra.lua``, checked."""
        if permit_id is not None and not (
            isinstance(permit_id, str) and 0 < len(permit_id) <= MAX_PERMIT_ID_LENGTH
        ):
            raise ConfigurationError(
                f"permit_id must be a str of 1 to {MAX_PERMIT_ID_LENGTH} characters, "
                f"got {permit_id!r:.80}",
                name=self.name,
            )
        if mode in (BOOK, RESERVE) and permit_id is None:
            what = "reserve" if mode == RESERVE else "book"
            raise ConfigurationError(f"{what}=True needs a permit_id to keep the slot for")
        cost = self.check_cost(cost, charge=mode == CHARGE)
        horizon = _TIMEOUT.check(max_wait, "max_wait", name=self.name)
        horizon_us = MAX_SECONDS * 1e6 if horizon is None else min(horizon, MAX_SECONDS) * 1e6
        keep_ms = math.ceil(self.keep * 1000)
        return [keep_ms, mode, math.floor(horizon_us), permit_id or "", cost, *self._window_args]

    def script_keys(self) -> list[str]:
        """The keys ``gcra.lua`` and ``rate_state.lua`` are given (one hash tag)."""
        return rate_keys(self.keys)

    def pause_args(self, seconds: float, forget: str | None = None) -> list[Any]:
        """The arguments of ``pause.lua`` for a pause of ``seconds`` (0: resume), checked."""
        return pause_args(self.name, seconds, forget)


def pause_args(name: str, seconds: float, forget: str | None = None) -> list[Any]:
    """The arguments of ``pause.lua`` for pausing ``name`` ``seconds`` (0: resume), the line
    forgetting the admission of the permit id ``forget`` (if given), checked."""
    checked = _PAUSE.check(seconds, "pause seconds", name=name)
    return [max(1, math.ceil(checked * 1000)) if checked else 0, forget or ""]


def rate_keys(keys: SemaphoreKeys) -> list[str]:
    """The keys of the rate limiter of ``keys``' name, as its scripts are given them."""
    return [keys.rate, keys.rate_line, keys.pause]


def charge_id_for(charge_id: str | None) -> str:
    """The id a charge is remembered under: ``charge_id``, or a new one (a call redis-py
    retries after a connection error sends the same id, so it charges once)."""
    return charge_id if charge_id is not None else f"charge:{new_permit_id()}"


def within(result: RateResult, timeout: float | None) -> bool:
    """Whether ``result``'s wait is at most ``timeout`` seconds (None: any)."""
    return timeout is None or result.retry_after <= timeout


def result_of(reply: Any) -> RateResult:
    """The :class:`RateResult` of a ``gcra.lua`` reply."""
    paused = len(reply) > 3 and bool(reply[3])
    return RateResult(bool(reply[0]), int(reply[1]) / 1e6, bool(reply[2]), paused)


@dataclass(frozen=True)
class WindowState:
    """One window of a rate limiter on the server's clock."""

    #: Units per second and units at once, as the last write stored them.
    rate: float
    burst: int
    #: The window's theoretical arrival time (server microseconds); None when idle.
    tat_us: int | None
    #: Units a start could take now (what remains of the burst; 0 when spent).
    remaining: int


@dataclass(frozen=True)
class RateState:
    """A snapshot of one rate limiter on the server's clock (``None``: no key, so idle).

    ``rate``, ``burst`` and ``tat_us`` are those of the first window; ``windows`` has them all.
    """

    name: str
    now_us: int
    #: Units per second of the first window, as the last admission stored it.
    rate: float | None
    burst: int | None
    #: The theoretical arrival time (server microseconds) of the first window; None when idle.
    tat_us: int | None
    #: Seconds from now until an attempt of one unit that books nothing would be admitted.
    next_free: float
    #: Slots booked ahead of now, and entries remembered (admitted ones too).
    booked: int
    remembered: int
    windows: tuple[WindowState, ...] = ()
    #: Seconds the limiter stays paused (0.0: not paused).
    paused: float = 0.0


def state_from_reply(name: str, reply: list[Any]) -> RateState:
    """The :class:`RateState` of a ``rate_state.lua`` reply."""
    now_us = int(float(as_text(reply[0])))
    windows, next_free = [], 0.0
    for n in range(4, len(reply) - 2, 3):
        tat, interval, size = (as_text(v) for v in reply[n : n + 3])
        if not (interval and size):
            continue
        tat_us, interval_us, burst = int(float(tat or 0)), int(float(interval)), int(float(size))
        ahead = max(0, tat_us - now_us)
        next_free = max(next_free, max(0, ahead - (burst - 1) * interval_us) / 1e6)
        windows.append(
            WindowState(
                rate=1e6 / interval_us,
                burst=burst,
                tat_us=tat_us if tat_us > now_us else None,
                remaining=max(0, (burst * interval_us - ahead) // interval_us),
            )
        )
    first = windows[0] if windows else None
    return RateState(
        name=name,
        now_us=now_us,
        rate=first.rate if first else None,
        burst=first.burst if first else None,
        tat_us=first.tat_us if first else None,
        next_free=next_free,
        booked=int(reply[1]),
        remembered=int(reply[2]),
        windows=tuple(windows),
        paused=int(reply[3]) / 1000,
    )
