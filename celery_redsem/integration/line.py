"""A task run's place in its semaphore's line: one try that keeps it, the wait in a worker slot
for the wake-up a release pushes, and the release that never raises.

Both sides use these: the pool child (:mod:`.guards.contention`) and admission in the worker's
main process (:mod:`.admission`).
"""

from __future__ import annotations

import logging
import math
import time

from celery_redsem.core.client import pop_within
from celery_redsem.core.errors import REDIS_ERRORS, BackendError
from celery_redsem.core.permits import Permit, Waiting
from celery_redsem.core.semaphore import FairSemaphore

__all__ = ["Answer", "attempt", "release_quietly", "server_ms", "wait_in_slot"]

logger = logging.getLogger(__name__)

#: What an ask made for a run gets: the permit, the place in line, or why there is neither.
Answer = Permit | Waiting | BackendError

_MIN_POLL = 0.005
#: A task waiting in its slot asks again at least this often (seconds), woken or not.
_ASK_AGAIN = 1.0


def attempt(
    sem: FairSemaphore,
    permit_id: str,
    *,
    waiter_lease: float,
    back_in: float = 0.0,
    notify: str | None = None,
) -> Permit | Waiting:
    """One try that keeps the task run's place in line (``permit_id``: see
    :func:`~celery_redsem.core.permit_ids.permit_id_of`).

    A grant that too few replicas acknowledged in time was not used (``min_replicas``): that
    is a fault of the deployment, retried like a Redis error.
    """
    result = sem.attempt(
        permit_id, join_line=True, waiter_lease=waiter_lease, back_in=back_in, notify=notify
    )
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
        if isinstance(again, Permit) or again.paused:  # (paused: waiting here is no use)
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
