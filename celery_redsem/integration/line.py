"""A task run's wait for its permit: where it stands (:class:`WaitState`), the message header
that carries it across retries, one try that keeps its place in line, and the wait in its slot.

The ``redsem_wait`` header is read (:func:`read_wait`) and written (:func:`stamp_wait`,
:func:`headers_with_wait`) here only; the pool child
(:mod:`~celery_redsem.integration.guards.contention`)
and admission in the main process (:mod:`~celery_redsem.integration.admission.dispatcher`) both go
through
these functions.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from celery.app.task import Context

from celery_redsem.core.client import pop_within
from celery_redsem.core.errors import REDIS_ERRORS, BackendError
from celery_redsem.core.permits import Permit, Waiting
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.integration.settings import RedsemConfig

__all__ = [
    "WAIT_HEADER",
    "WaitState",
    "attempt",
    "headers_with_wait",
    "present_waiter_lease",
    "read_wait",
    "read_wait_of",
    "release_quietly",
    "server_ms",
    "stamp_wait",
    "stamp_wait_began",
    "wait_in_slot",
]

logger = logging.getLogger(__name__)

#: Message header carrying a :class:`WaitState` (and the task's own retry count).
WAIT_HEADER = "redsem_wait"
#: Highest retry count read from a ``redsem_wait`` header.
_MAX_COUNT = 64
_MIN_POLL = 0.005
#: A task waiting in its slot asks again at least this often (seconds), woken or not.
_ASK_AGAIN = 1.0


class WaitState(NamedTuple):
    """Where a task stands in its wait for a permit; travels in the ``redsem_wait`` header."""

    #: Contention retries so far.
    attempts: int = 0
    #: Server ms when the wait began (0: Redis has not answered yet).
    first_ms: int = 0
    #: Retries because Redis failed (unreachable, restarting, too few replicas).
    errors: int = 0
    #: Server ms when the task was due back after its last contention retry (0: none yet).
    due_ms: int = 0
    #: Milliseconds spent on retries after Redis errors since then (countdowns and tries).
    offline_ms: int = 0

    def _header(self, retries: int) -> list[int]:
        """The header value; ``retries`` (the task's own) tells a later own retry apart."""
        return [self.attempts, self.first_ms, retries, self.errors, self.due_ms, self.offline_ms]


def read_wait(request: Context) -> WaitState:
    """The :class:`WaitState` this run of the task starts from (fresh if none or stale).

    Reads ``[attempts, first ms, retries, errors, due ms, offline ms]`` and the older
    ``[attempts, first ms, retries]``.
    """
    headers = request.headers or {}
    value = headers.get(WAIT_HEADER, getattr(request, WAIT_HEADER, None))
    if not isinstance(value, list | tuple) or len(value) not in (3, 6):
        return WaitState()
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return WaitState()
    attempts, first_ms, retries, *rest = value
    if retries != request.retries:  # the task's own retry since: a fresh wait
        return WaitState()
    errors, due_ms, offline_ms = rest or (0, 0, 0)
    # Counts feed an exponential backoff (2 ** n): bounded, whatever a message says.
    return WaitState(
        min(attempts, _MAX_COUNT), first_ms, min(errors, _MAX_COUNT), due_ms, offline_ms
    )


def headers_with_wait(request: Context, wait: WaitState) -> dict[str, Any]:
    """``request``'s headers with ``wait`` in them, for the message of its retry."""
    return {**(request.headers or {}), WAIT_HEADER: wait._header(request.retries)}


def stamp_wait(request_dict: dict[str, Any], wait: WaitState) -> None:
    """Put ``wait`` in a worker request's dict (and its headers), for the pool child."""
    value = wait._header(int(request_dict.get("retries") or 0))
    request_dict[WAIT_HEADER] = value
    headers = request_dict.get("headers")
    if isinstance(headers, Mapping):
        request_dict["headers"] = {**headers, WAIT_HEADER: value}


def read_wait_of(request_dict: dict[str, Any]) -> WaitState:
    """:func:`read_wait` for a worker request's dict (in the worker's main process)."""
    return read_wait(Context(request_dict))


def stamp_wait_began(request_dict: dict[str, Any], first_ms: int) -> None:
    """Tell the child when the wait of a worker request began (server ms); it fails the task
    once ``max_wait`` is spent."""
    wait = read_wait_of(request_dict)
    stamp_wait(request_dict, WaitState(wait.attempts, first_ms, wait.errors, 0, 0))


def present_waiter_lease(config: RedsemConfig) -> float:
    """The waiter lease of a task asking now: it keeps its place for the shortest countdown
    plus the margin, enough to be re-published or parked before asking again with its own."""
    return config.waiter_margin + config.retry_min_countdown


def attempt(
    sem: FairSemaphore, permit_id: str, *, waiter_lease: float, back_in: float = 0.0
) -> Permit | Waiting:
    """One try that keeps the task run's place in line (``permit_id``: see
    :func:`~celery_redsem.core.permit_ids.permit_id_of`).

    A grant that too few replicas acknowledged in time was not used (``min_replicas``): that
    is a fault of the deployment, retried like a Redis error.
    """
    result = sem.attempt(permit_id, join_line=True, waiter_lease=waiter_lease, back_in=back_in)
    if isinstance(result, Waiting) and not result.expires_at:
        raise BackendError(
            f"a permit of {sem.name!r} was granted but not acknowledged by "
            f"min_replicas={sem.min_replicas} replicas in time, so it was not used",
            name=sem.name,
            permit_id=permit_id,
        )
    return result


def server_ms(result: Permit | Waiting, waiter_lease: float) -> int:
    """The server's clock (ms) when ``result`` was decided, from the expiry it carries."""
    if isinstance(result, Permit):
        return result.expires_at - math.ceil(result.lease * 1000)
    return result.expires_at - math.ceil(waiter_lease * 1000)


def wait_in_slot(
    sem: FairSemaphore,
    permit_id: str,
    result: Waiting,
    *,
    waiter_lease: float,
    seconds: float,
    hold: float | None,
) -> Permit | Waiting:
    """Wait in this worker slot for a permit for up to ``seconds`` (see
    :func:`~celery_redsem.integration.policy.head_wait_budget`).

    A release pushes a wake-up to the first waiters in line; a task further back, or behind
    waiters that are away, asks again after about one release (``hold / limit``) instead.
    Each look for the wake-up ends within the client's socket timeout
    (:func:`~celery_redsem.core.client.pop_within`), so a wait is never mistaken for a Redis
    that does not answer.
    """
    deadline = time.monotonic() + seconds
    wake = sem.keys.wake(permit_id)
    poll = _ASK_AGAIN if hold is None else min(_ASK_AGAIN, max(_MIN_POLL, hold / sem.limit))
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return result
        try:
            pop_within(sem.client, wake, max(_MIN_POLL, min(remaining, poll)))
        except REDIS_ERRORS as exc:
            raise BackendError(
                f"Redis failed while waiting for {sem.name!r}: {exc}", name=sem.name
            ) from exc
        again = attempt(sem, permit_id, waiter_lease=waiter_lease)
        if isinstance(again, Permit):
            return again
        result = again


def release_quietly(sem: FairSemaphore, permit: Permit | str) -> bool | None:
    """Give ``permit`` (or a place in line) back: True if it was held, False if not, None if
    Redis failed (logged: it frees itself when its lease ends)."""
    try:
        return sem.release(permit)
    except BackendError as exc:
        pid = permit.id if isinstance(permit, Permit) else permit
        logger.warning(
            "celery_redsem: could not release %r of %r (it frees itself when its lease ends): %s",
            pid,
            sem.name,
            exc,
        )
        return None
