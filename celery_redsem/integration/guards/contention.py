"""A run in a pool child asking for its permit: it gets one, waits in its slot, or retries.

:class:`Contention` asks once (joining the FIFO line under the run's permit id); without a
permit it waits for it in its slot if it is near
(:func:`~celery_redsem.integration.policy.head_wait_budget`), else it re-publishes the task
with a countdown and raises Celery's ``Retry``, its place in line holding a free permit for it
only from about when it is expected back (the countdown plus the delivery delay learnt for its
queue, :class:`~celery_redsem.integration.policy.ReturnDelays`). That contention retry keeps
``request.retries`` as it is and never touches ``max_retries``; its count and timing travel in
the ``redsem_wait`` header (:class:`~celery_redsem.integration.line.WaitState`). A task whose
wait exceeds ``max_wait`` leaves the line and fails with :class:`~celery_redsem.AcquireTimeout`.

When Redis cannot be reached (a :class:`~celery_redsem.BackendError` that is
:attr:`~celery_redsem.BackendError.transient`) the task is retried the same way, with an
exponential backoff counted apart in the header; that time counts toward ``max_wait``, after
which the task fails with the ``BackendError``. A refusal no retry can fix (a wrong password,
a missing ACL permission, a script error) fails the task at once.

While the key is paused (``pause``), the run is re-published for the pause's end, asking again
at least every ``redsem_retry_backoff_max`` seconds (:func:`paused_recheck`) so a resume takes
effect: whatever ``max_wait`` says (the pause does not count toward it), it fails none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NoReturn, cast

from celery import Task
from celery.app.task import Context
from celery.exceptions import Retry

from celery_redsem.core.errors import AcquireTimeout, BackendError
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit, Waiting
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.integration.line import attempt, release_quietly, server_ms, wait_in_slot
from celery_redsem.integration.policy import (
    contention_countdown,
    error_countdown,
    head_wait_budget,
    hold_times,
    return_delays,
)
from celery_redsem.integration.settings import RedsemConfig
from celery_redsem.integration.wire import WaitState, headers_with_wait, read_wait
from celery_redsem.metrics import record_timeout, record_wait

__all__ = ["Contention", "paused_recheck"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Contention:
    """One run of a guarded task in a pool child, waiting for what ``name`` gives (a semaphore's
    permit, or a rate limiter's start); ``what`` says it in messages (``"a permit of 'k'
    (limit 2)"``)."""

    task: Task[Any, Any]
    request: Context
    name: str
    what: str
    #: The wait budget in seconds (None: no cap).
    max_wait: float | None
    config: RedsemConfig

    def permit_or_retry(self, sem: FairSemaphore, *, standby: bool = False) -> Permit:
        """A permit of ``sem``; raises Celery's ``Retry`` (or fails) when none can be had.
        A ``standby`` (sent to its slot by admission to wait for the next release) waits up to
        ``redsem_head_wait`` for it, whatever its estimate says."""
        wait = read_wait(self.request)
        started = time.monotonic()
        try:
            return self._attempt_or_wait(sem, wait, standby)
        except BackendError as exc:
            self.retry_after_error(exc, started=started)

    def _attempt_or_wait(self, sem: FairSemaphore, wait: WaitState, standby: bool) -> Permit:
        """Ask once; wait in the slot if the permit is near, else re-publish with a countdown."""
        task, request, config = self.task, self.request, self.config
        permit_id = permit_id_of(request)  # this run's: see run_permit_id
        queue = _queue_of(task, request)
        waiter_lease = config.present_waiter_lease
        result = attempt(sem, permit_id, waiter_lease=waiter_lease)
        now_ms = server_ms(result, waiter_lease)
        if wait.due_ms and not wait.offline_ms:  # back from a contention retry: how late?
            return_delays.observe(queue, (now_ms - wait.due_ms) / 1000)
        if isinstance(result, Permit):
            return result
        self._unless_paused(sem, result)
        # The first answer from Redis starts the wait, backdated by any time spent unable to
        # reach it before that.
        # (Never later than now: a header claiming so, forged or from a server whose clock
        # went back, would stop the wait from ever counting toward max_wait.)
        first_ms = min(wait.first_ms or now_ms - wait.offline_ms, now_ms)
        waited = max(0, now_ms - first_ms) / 1000
        max_wait = self.max_wait
        hold = hold_times.estimate(task.name)
        budget = head_wait_budget(
            position=result.position,
            limit=sem.limit,
            hold_estimate=hold,
            head_wait=config.head_wait,
        )
        if standby and result.position <= sem.limit:
            budget = config.head_wait
        if max_wait is not None:
            budget = min(budget, max_wait - waited)
        if budget > 0:
            result = wait_in_slot(
                sem, permit_id, result, waiter_lease=waiter_lease, seconds=budget, hold=hold
            )
            if isinstance(result, Permit):
                return result
            self._unless_paused(sem, result)
            now_ms = server_ms(result, waiter_lease)
            waited = max(0, now_ms - first_ms) / 1000
        if max_wait is not None and waited >= max_wait:
            release_quietly(sem, permit_id)
            record_timeout(task.name)
            raise AcquireTimeout(
                f"task {task.name}[{request.id}] waited {waited:.1f}s for a permit of "
                f"{sem.name!r} (limit {sem.limit}) and gave up (max_wait={max_wait}s, "
                f"{wait.attempts} retries, position {result.position} in line)",
                name=sem.name,
                permit_id=permit_id,
            )
        countdown = contention_countdown(
            attempt=wait.attempts,
            position=result.position,
            limit=sem.limit,
            hold_estimate=hold,
            backoff=config.retry_backoff,
            backoff_max=config.retry_backoff_max,
            jitter=config.retry_jitter,
            floor=config.retry_min_countdown,
        )
        countdown = self._within_budget(countdown, waited)
        # Keep the place until the task is back. The broker hands the retry back only after
        # the messages queued before it, so the task is back around its countdown plus the
        # delay learnt for this queue; until then its place does not hold a free permit (one
        # goes to whoever is present, in line order), and the place outlives that by the margin.
        back_in = countdown + return_delays.estimate(queue)
        again = attempt(
            sem, permit_id, waiter_lease=back_in + config.waiter_margin, back_in=back_in
        )
        if isinstance(again, Permit):
            return again
        self._unless_paused(sem, again)
        due_ms = now_ms + round(countdown * 1000)
        after = WaitState(wait.attempts + 1, first_ms, wait.errors, due_ms, 0)
        record_wait(task.name, "retry")
        raise self.publish_retry(
            countdown,
            after,
            release=sem,
            reason=f"no permit of {sem.name!r} (limit {sem.limit}) yet; "
            f"position {result.position} in line",
        )

    def try_once(self, sem: FairSemaphore, *, started: float) -> Permit | None:
        """One try for a permit, not joining the line (``on_busy`` not "wait"): None if none
        is free. A paused key is not a busy one: the run is retried to the pause's end."""
        try:
            result = sem.attempt(permit_id_of(self.request))
        except BackendError as exc:
            self.retry_after_error(exc, started=started)
        if isinstance(result, Waiting) and result.paused:
            raise self.retry_paused(result.paused, f"semaphore {sem.name!r} is paused")
        return result if isinstance(result, Permit) else None

    def _unless_paused(self, sem: FairSemaphore, result: Waiting) -> None:
        """Re-publish the run for the end of ``sem``'s pause (raises ``Retry``) if it is paused;
        the wait starts anew after it (a pause does not count toward ``max_wait``)."""
        if result.paused:
            reason = f"semaphore {sem.name!r} is paused for {result.paused:.3f}s"
            raise self.retry_paused(result.paused, reason, restart_wait=True)

    def retry_paused(self, left: float, reason: str, *, restart_wait: bool = False) -> Retry:
        """The ``Retry`` of a run whose key stays paused ``left`` seconds more: re-published
        for the pause's end (asking again at least every :func:`paused_recheck`) as a
        contention retry, ``max_retries`` untouched; ``restart_wait``: its wait so far no
        longer counts toward ``max_wait``."""
        earlier = read_wait(self.request)
        first_ms = 0 if restart_wait else earlier.first_ms
        wait = earlier._replace(
            attempts=earlier.attempts + 1, first_ms=first_ms, due_ms=0, offline_ms=0
        )
        countdown = min(left, paused_recheck(self.config))
        return self.publish_retry(countdown, wait, release=None, reason=reason)

    def retry_after_error(self, error: BackendError, *, started: float) -> NoReturn:
        """Redis could not be reached (since monotonic time ``started``): retry through Celery
        with a backoff, or fail at once if the error is not transient.

        Like a contention retry it spares ``max_retries``; its own count travels in the header.
        The time spent so (countdowns plus the failed tries) counts toward ``max_wait``, and
        once that is spent the task fails with the :class:`BackendError`.
        """
        task, request, config, name = self.task, self.request, self.config, self.name
        wait = read_wait(request)
        task_id = cast(str, request.id)
        if not error.transient:
            raise BackendError(
                f"task {task.name}[{task_id}] could not get {self.what}: Redis refused in a "
                "way no retry can fix "
                f"({type(error.__cause__).__name__}): {error}",
                name=name,
                permit_id=task_id,
            ) from error
        offline_ms = wait.offline_ms + round((time.monotonic() - started) * 1000)
        # Without a server clock: the wait known at the last answer, plus the time offline.
        known = max(0, wait.due_ms - wait.first_ms) if wait.first_ms else 0
        waited = (known + offline_ms) / 1000
        if self.max_wait is not None and waited >= self.max_wait:
            raise BackendError(
                f"task {task.name}[{task_id}] could not get {self.what} because Redis "
                "failed; it gave up after about "
                f"{waited:.1f}s (max_wait={self.max_wait}s, {wait.errors} retries after Redis "
                f"errors): {error}",
                name=name,
                permit_id=task_id,
            ) from error
        countdown = error_countdown(
            attempt=wait.errors,
            backoff=config.retry_backoff,
            backoff_max=config.retry_backoff_max,
            jitter=config.retry_jitter,
            floor=config.retry_min_countdown,
        )
        countdown = self._within_budget(countdown, waited)
        logger.log(
            _outage_level(),
            "celery_redsem: %s[%s] could not reach Redis for %s, retrying in "
            "%.2fs (retry %d after Redis errors): %s",
            task.name,
            task_id,
            self.what,
            countdown,
            wait.errors + 1,
            error,
        )
        after = WaitState(
            wait.attempts,
            wait.first_ms,
            wait.errors + 1,
            wait.due_ms,
            offline_ms + round(countdown * 1000),
        )
        raise self.publish_retry(
            countdown,
            after,
            release=None,
            reason=f"Redis failed while asking for {self.what}: {error}",
            error=error,
        )

    def _within_budget(self, countdown: float, waited: float) -> float:
        """``countdown``, cut to what is left of ``max_wait`` (never below the minimum)."""
        if self.max_wait is None:
            return countdown
        return max(self.config.retry_min_countdown, min(countdown, self.max_wait - waited))

    def publish_retry(
        self,
        countdown: float,
        wait: WaitState,
        *,
        release: FairSemaphore | None,
        reason: str,
        error: Exception | None = None,
    ) -> Retry:
        """Re-publish the task (same id) with ``countdown`` and ``wait`` in its header; return
        the Celery ``Retry`` for the caller to raise, so this run ends in state RETRY.

        If publishing fails, the place in ``release`` (if given) is given up before re-raising.
        """
        request = self.request
        headers = headers_with_wait(request, wait)
        sig = self.task.signature_from_request(
            request,
            countdown=countdown,
            headers=headers,
            ignore_result=_ignore_result(self.task, request),
        )
        try:
            sig.apply_async()
        except Exception:
            if release is not None:
                release_quietly(release, permit_id_of(request))
            raise
        return Retry(
            f"{reason}; asking again in {countdown:.3f}s",
            exc=error,
            when=cast(Any, countdown),
            sig=sig,
        )


def paused_recheck(config: RedsemConfig) -> float:
    """Seconds a run of a paused key waits at most before it asks again (parked, or through
    the broker): ``redsem_retry_backoff_max`` (at least 1 s), so a resume takes effect."""
    return max(1.0, config.retry_backoff_max)


#: While Redis cannot be reached, one warning at most this often (seconds) per process; the
#: other retries are logged at INFO (every task of a busy worker retries while it is down).
OUTAGE_WARNING_EVERY = 10.0
_last_outage_warning = [-OUTAGE_WARNING_EVERY]


def _outage_level() -> int:
    """WARNING for the first retry after a Redis error in :data:`OUTAGE_WARNING_EVERY`
    seconds, INFO for the others."""
    now = time.monotonic()
    if now - _last_outage_warning[0] < OUTAGE_WARNING_EVERY:
        return logging.INFO
    _last_outage_warning[0] = now
    return logging.WARNING


def _ignore_result(task: Task[Any, Any], request: Context) -> bool:
    """Whether the run is to store no result: as its sender said (the message carries it),
    else as the task says. Celery before 5.7 leaves it out of a signature made from the
    request, so a retry of a send with ``ignore_result=True`` stored its result."""
    said = vars(request).get("ignore_result")  # (Context's class attribute is no choice)
    return bool(task.ignore_result if said is None else said)


def _queue_of(task: Task[Any, Any], request: Context) -> str:
    """The queue (routing key) the task came through: return delays are learnt per queue."""
    info = request.delivery_info or {}
    return str(info.get("routing_key") or getattr(task, "queue", None) or task.name)
