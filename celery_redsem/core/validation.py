"""What a number of seconds, a count or a choice must be: one rule each, one wording.

The core (:class:`~celery_redsem.FairSemaphore`), the decorators and the settings reader all
check their arguments with these rules, so a fix (a bool is not a number; an absurd duration
is refused before a script could store it) lands in one place. A :class:`Rule` says what a
value must be (for messages) and whether one is; :meth:`Rule.check` raises
:class:`~celery_redsem.ConfigurationError` naming the argument and the value.

Bounds: seconds at most :data:`MAX_SECONDS` (a year: leases, TTLs and waits are stored as
server milliseconds, and far larger values overflow what a script can count exactly); counts
(``limit``) at most :data:`MAX_COUNT`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from celery_redsem.core.errors import ConfigurationError

__all__ = [
    "LIMIT",
    "MAX_COUNT",
    "MAX_NAME_LENGTH",
    "MAX_SECONDS",
    "SECONDS",
    "SECONDS_OR_ZERO",
    "Rule",
    "choice_rule",
    "count_rule",
    "seconds_rule",
    "validate_name",
    "validate_prefix",
]

#: The longest duration any argument or setting may have, in seconds (365 days).
MAX_SECONDS = 365 * 24 * 3600.0
#: The highest count (a semaphore's ``limit``) accepted.
MAX_COUNT = 1_000_000_000


@dataclass(frozen=True)
class Rule:
    """What a value must be (``expected``, for messages) and the test of one (``accepts``)."""

    expected: str
    accepts: Callable[[Any], bool]
    #: What an accepted value becomes (seconds: a float).
    convert: Callable[[Any], Any] = lambda value: value

    def check(self, value: Any, what: str, *, name: str | None = None) -> Any:
        """``value`` (converted) if the rule accepts it, else a :class:`ConfigurationError`
        about ``what`` (``name``: the semaphore, if one is concerned)."""
        if not self.accepts(value):
            raise ConfigurationError(f"{what} must be {self.expected}, got {value!r}", name=name)
        return self.convert(value)


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def seconds_rule(*, zero_ok: bool = False, none_ok: bool = False, inf_ok: bool = False) -> Rule:
    """A number of seconds: > 0 (>= 0 with ``zero_ok``), at most :data:`MAX_SECONDS`
    (``math.inf`` too with ``inf_ok``), or None with ``none_ok``. A bool is not a number."""
    low = ">= 0" if zero_ok else "> 0"
    high = " or inf" if inf_ok else ""
    expected = f"a number of seconds {low} and <= {MAX_SECONDS:.0f}{high}"
    if none_ok:
        expected += " or None"

    def accepts(value: Any) -> bool:
        if value is None:
            return none_ok
        if not _is_number(value) or math.isnan(value):
            return False
        if math.isinf(value):
            return inf_ok and value > 0
        return (value > 0 or (zero_ok and value == 0)) and value <= MAX_SECONDS

    return Rule(expected, accepts, lambda value: None if value is None else float(value))


def count_rule(*, minimum: int = 1, none_ok: bool = False, maximum: int = MAX_COUNT) -> Rule:
    """An int from ``minimum`` to ``maximum`` (or None with ``none_ok``); a bool is not one."""
    expected = f"an int >= {minimum} and <= {maximum}" + (" or None" if none_ok else "")

    def accepts(value: Any) -> bool:
        if value is None:
            return none_ok
        return (
            isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum
        )

    return Rule(expected, accepts)


def choice_rule(choices: Sequence[str]) -> Rule:
    """One of ``choices``."""
    expected = "one of " + ", ".join(repr(c) for c in choices)
    return Rule(expected, lambda value: isinstance(value, str) and value in choices)


#: The rules the package uses most, built once.
SECONDS = seconds_rule()
SECONDS_OR_ZERO = seconds_rule(zero_ok=True)
LIMIT = count_rule()


#: The longest semaphore name accepted.
MAX_NAME_LENGTH = 512


def validate_name(name: object) -> str:
    """Return ``name`` if it is a usable semaphore name, else raise :class:`ConfigurationError`."""
    if not isinstance(name, str):
        raise ConfigurationError(f"semaphore name must be a str, got {type(name).__name__}")
    if not name:
        raise ConfigurationError("semaphore name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigurationError(
            f"semaphore name is {len(name)} characters long; the maximum is {MAX_NAME_LENGTH}",
            name=name[:80] + "...",
        )
    if "{" in name or "}" in name:
        raise ConfigurationError(
            f"semaphore name {name!r} must not contain '{{' or '}}' (the cluster hash tag)",
            name=name,
        )
    return name


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a usable key prefix, else raise :class:`ConfigurationError`."""
    if not isinstance(prefix, str) or not prefix:
        raise ConfigurationError(f"key prefix must be a non-empty str, got {prefix!r}")
    if "{" in prefix or "}" in prefix or "*" in prefix:
        raise ConfigurationError(f"key prefix {prefix!r} must not contain '{{', '}}' or '*'")
    return prefix
