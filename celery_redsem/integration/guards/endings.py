"""What a run does when its key is busy and it is not to wait: ``on_busy="skip"`` or ``"fail"``.

Such a run asks once, without joining the waiting line (so it never keeps a place, and nobody
waits behind it). Without a permit it ends at once without its body:

* ``"skip"``: in state SUCCESS with result None, with one INFO log line and the
  :data:`~celery_redsem.signals.task_skipped` signal (``reason="busy"``). A run
  that ``dedupe=True`` finds to be a duplicate ends the same way (``reason="duplicate"``).
* ``"fail"``: with :class:`~celery_redsem.Busy`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import Task

from celery_redsem.core.errors import Busy
from celery_redsem.core.permits import Permit
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.core.validation import choice_rule
from celery_redsem.metrics import record_skip
from celery_redsem.signals import task_skipped

__all__ = ["ON_BUSY", "ON_BUSY_CHOICES", "busy", "skipped", "try_once"]

logger = logging.getLogger(__name__)

#: What a run does when its key is busy: wait its turn, end without its body, or fail.
ON_BUSY_CHOICES = ("wait", "skip", "fail")
ON_BUSY = choice_rule(ON_BUSY_CHOICES)


def try_once(sem: FairSemaphore, permit_id: str) -> Permit | None:
    """One try for a permit under ``permit_id``, not joining the line; None if none is free."""
    result = sem.attempt(permit_id)
    return result if isinstance(result, Permit) else None


def skipped(
    task: Task[Any, Any] | None,
    task_id: str | None,
    name: str,
    reason: str,
    *,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    """Log and signal that the run ``task_id`` of ``task`` ended without its body; None is
    the run's result."""
    task_name = task.name if task is not None else "?"
    why = (
        "its key is busy (on_busy='skip')"
        if reason == "busy"
        else "another run of its key is queued or running (dedupe=True)"
    )
    logger.info("celery_redsem: %s[%s] skipped: %s; semaphore %r", task_name, task_id, why, name)
    record_skip(task_name)
    task_skipped.send(
        sender=task, task_id=task_id, name=name, reason=reason, args=args, kwargs=dict(kwargs)
    )


def busy(task_name: str, task_id: str | None, sem: FairSemaphore) -> Busy:
    """The :class:`Busy` for a run with ``on_busy="fail"`` that found ``sem`` full."""
    return Busy(
        f"task {task_name}[{task_id}] did not run: its key is busy ({sem.name!r}, limit "
        f"{sem.limit}) and on_busy='fail'",
        name=sem.name,
        permit_id=task_id,
    )
