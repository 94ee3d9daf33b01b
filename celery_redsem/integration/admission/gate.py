"""Which tasks admission decides for, and its pause after a Redis error.

:class:`Gate` picks the one guard of a task that admission asks for in the worker's main
process (:mod:`~celery_redsem.integration.admission.dispatcher`); every other task goes straight to
its
pool child, which asks, waits or retries there
(:mod:`~celery_redsem.integration.guards.contention`).
After a Redis error it lets every task through for :data:`PAUSE_AFTER_ERROR` seconds, doubling
with each error in a row up to :data:`MAX_PAUSE_AFTER_ERROR`: a Redis that hangs (rather than
refuses) would cost each ask a socket timeout in the event loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery_redsem.core.errors import BackendError
from celery_redsem.integration.dedupe.run_mark import DUPLICATE_FIELD
from celery_redsem.integration.guards.naming import SlowKeyFunctions
from celery_redsem.integration.guards.rate_guard import RateGuard, rate_guards_of
from celery_redsem.integration.guards.semaphore_guard import TaskGuard, guards_of

__all__ = ["MAX_PAUSE_AFTER_ERROR", "PAUSE_AFTER_ERROR", "Gate"]

logger = logging.getLogger(__name__)

#: Seconds admission hands every task straight to the pool after a Redis error, doubling
#: with each error in a row up to :data:`MAX_PAUSE_AFTER_ERROR`.
PAUSE_AFTER_ERROR = 5.0
MAX_PAUSE_AFTER_ERROR = 60.0


class Gate:
    """The guard admission asks for, per task, and the pause after Redis errors."""

    def __init__(self) -> None:
        self.paused_until = 0.0
        self.paused_at = 0.0  # when the latest pause began
        self._errors_in_row = 0  # Redis errors since admission last got an answer
        self.slow_keys = SlowKeyFunctions()  # tasks whose key function is too slow for here

    def guard_of(self, req: Any) -> TaskGuard | RateGuard | None:
        """The one guard of ``req``'s task if admission decides for it, else None."""
        if time.monotonic() < self.paused_until:
            return None
        task = getattr(req, "task", None)
        if task is None or task.name in self.slow_keys:
            return None
        guards: list[TaskGuard | RateGuard] = [*guards_of(task), *rate_guards_of(task)]
        if len(guards) != 1 or req.revoked():
            return None
        if getattr(guards[0], "on_busy", "wait") != "wait":
            return None  # one try, never parked: its child asks, then runs, skips or fails
        if req.request_dict.get(DUPLICATE_FIELD):
            return None  # ends at once in its child as a duplicate of the run with the mark
        return guards[0]

    def answered(self) -> None:
        """Redis answered: the next error pauses for :data:`PAUSE_AFTER_ERROR` again."""
        self._errors_in_row = 0

    def pause(self, exc: BackendError) -> None:
        """Hand every task straight to the pool for a while after a Redis error."""
        pause = min(MAX_PAUSE_AFTER_ERROR, PAUSE_AFTER_ERROR * 2.0**self._errors_in_row)
        self._errors_in_row += 1
        self.paused_at = time.monotonic()
        self.paused_until = self.paused_at + pause
        logger.warning(
            "celery_redsem: admission paused for %.0fs after a Redis error: %s", pause, exc
        )
