"""The permits held by the guarded calls running in this context (thread or coroutine).

A guarded task's body runs with its permit *entered* here, so :func:`current_permit` can hand
it to the body (its fencing token) and a guarded call made inside that body on the same
semaphore runs under the permit already held instead of waiting for one it can never get.
A rate-limited body runs with its limiter entered (:func:`enter_rate`), so
:func:`current_rate_limiter` hands it the limiter of its own key (to charge units after the
fact).
"""

from __future__ import annotations

import threading
from contextvars import ContextVar, Token
from dataclasses import dataclass

from celery_redsem.core.heartbeat import HeldPermit
from celery_redsem.core.rate_limit import RateLimiter

__all__ = [
    "Entered",
    "current_permit",
    "current_rate_limiter",
    "enter",
    "enter_rate",
    "held_by_caller",
    "leave",
    "leave_rate",
]


@dataclass(frozen=True)
class _Entry:
    """A permit a guarded call holds while its body runs, in the thread running it."""

    held: HeldPermit
    limit: int
    thread_id: int


Entered = Token[tuple[_Entry, ...]]

#: Every permit held by the guarded calls running in this context, outermost first (the last
#: is :func:`current_permit`).
_entered: ContextVar[tuple[_Entry, ...]] = ContextVar("celery_redsem_entered", default=())


def current_permit() -> HeldPermit | None:
    """The permit of the innermost guarded task running in this context, or None.

    Its ``token`` is the fencing token; ``check()`` raises :class:`~celery_redsem.PermitLost`
    if the lease was lost.
    """
    entered = _entered.get()
    return entered[-1].held if entered else None


#: The rate limiters of the rate-limited calls running in this context, outermost first.
_limiters: ContextVar[tuple[RateLimiter, ...]] = ContextVar("celery_redsem_limiters", default=())


def current_rate_limiter() -> RateLimiter | None:
    """The rate limiter of the innermost ``@with_rate_limit`` task running in this context
    (its key's, with the task's windows), or None: ``current_rate_limiter().charge(units)``
    adds units known only after the fact, delaying the key's later starts."""
    limiters = _limiters.get()
    return limiters[-1] if limiters else None


def enter_rate(limiter: RateLimiter) -> Token[tuple[RateLimiter, ...]]:
    """The call running now was admitted by ``limiter``; :func:`leave_rate` when it ends."""
    return _limiters.set((*_limiters.get(), limiter))


def leave_rate(token: Token[tuple[RateLimiter, ...]]) -> None:
    """The call that :func:`enter_rate` returned ``token`` for has ended."""
    _limiters.reset(token)


def enter(held: HeldPermit, limit: int) -> Entered:
    """``held`` (of a semaphore with ``limit``) is held by the call running now, in this
    thread; :func:`leave` with the token returned when its body ends."""
    return _entered.set((*_entered.get(), _Entry(held, limit, threading.get_ident())))


def leave(token: Entered) -> None:
    """The call that :func:`enter` returned ``token`` for no longer holds its permit."""
    _entered.reset(token)


def held_by_caller(name: str, prefix: str, limit: int) -> HeldPermit | None:
    """The permit of semaphore ``name`` (keys under ``prefix``, limit ``limit``) that a guarded
    call running in this thread holds, if any (not one from a context copied to another
    thread)."""
    me = threading.get_ident()
    for entry in reversed(_entered.get()):
        held = entry.held
        if (
            held.name == name
            and held.permit.prefix == prefix
            and entry.limit == limit
            and entry.thread_id == me
        ):
            return held
    return None
