"""De-duplication (``dedupe=True`` or ``"raise"``): one run per key queued or running at a time.

The mark (:class:`~celery_redsem.core.marks.DedupeMark`) is taken when the task is sent
(:mod:`~celery_redsem.integration.sending`), under the name the run will compute: the task's key
function over the arguments sent. A send that finds another live run's mark gets that run's
``AsyncResult`` back (``"raise"``: :class:`~celery_redsem.AlreadyQueued`) and queues nothing.

The run keeps the mark (:class:`RunMark`): it takes it again as it starts (so a message that
came by another way, ``send_task`` by name, still takes it or, if another run has it, ends as a
duplicate), then, once it holds its permit, ties it to the permit: from then on the mark lives
exactly as long as the permit's lease, which the heartbeat renews, so a lost worker frees the
key within a lease. It is cleared on every way the run ends (success, failure, skip; revoke,
expiry and a lost child from the worker's main process), but kept across a retry (the same task
id comes back). A queued run's mark lives for ``redsem_dedupe_lease`` seconds from its send
(plus the send's countdown or ETA), so a lost message cannot block the key for longer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import Celery, Task
from celery.app.task import Context

from celery_redsem.core.errors import AlreadyQueued, BackendError
from celery_redsem.core.marks import DedupeMark
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.core.validation import Rule
from celery_redsem.integration.busy import skipped
from celery_redsem.integration.config import RedsemConfig, get_client, get_config
from celery_redsem.integration.waiting import release_quietly

__all__ = ["DEDUPE", "RunMark", "clear_quietly", "end_duplicate", "mark_of", "queued_ttl"]

logger = logging.getLogger(__name__)

#: ``dedupe=``: off, on (a repeated send gets the queued run's result), or raise.
DEDUPE = Rule("False, True or 'raise'", lambda value: value in (False, True, "raise"))


def mark_of(app: Celery, name: str, config: RedsemConfig | None = None) -> DedupeMark:
    """The de-duplication mark of semaphore ``name`` in ``app``'s Redis."""
    config = config or get_config(app)
    return DedupeMark(get_client(app), name, prefix=config.key_prefix)


def queued_ttl(config: RedsemConfig, options: Mapping[str, Any]) -> float:
    """Seconds a send's mark lives while its run is queued: ``redsem_dedupe_lease`` plus the
    send's ``countdown`` or ``eta`` (the message waits that long before it can run)."""
    delay = 0.0
    countdown, eta = options.get("countdown"), options.get("eta")
    if isinstance(countdown, int | float) and not isinstance(countdown, bool):
        delay = float(countdown)
    elif isinstance(eta, datetime):
        delay = eta.timestamp() - time.time()
    return config.dedupe_lease + min(max(0.0, delay), config.dedupe_lease * 24)


class RunMark:
    """The mark of a running task run ``task_id`` on semaphore ``name``."""

    def __init__(self, app: Celery, name: str, task_id: str, config: RedsemConfig) -> None:
        self.mark = mark_of(app, name, config)
        self.task_id = task_id
        self.ttl = config.dedupe_lease

    def claim(self) -> str | None:
        """Take the mark as the run starts: None if this run has it, else the id of the run
        that does (this one is a duplicate). If Redis fails the run goes on (logged): the
        permit still limits it."""
        try:
            holder = self.mark.take(self.task_id, self.ttl)
        except BackendError as exc:
            logger.warning(
                "celery_redsem: could not check the dedupe mark of %r for run %s: %s",
                self.mark.name,
                self.task_id,
                exc,
            )
            return None
        return None if holder == self.task_id else holder

    def hold(self, permit_id: str) -> None:
        """Tie the mark to the run's permit (best effort: a failure is logged)."""
        try:
            self.mark.hold(self.task_id, permit_id, self.ttl)
        except BackendError as exc:
            logger.warning("celery_redsem: could not keep the dedupe mark of %r: %s", self, exc)

    def clear(self) -> None:
        """Remove the mark if it is still this run's (best effort: else it ends with its
        lease)."""
        clear_quietly(self.mark, self.task_id)

    def __repr__(self) -> str:
        return f"<RunMark {self.mark.name!r} {self.task_id}>"


def clear_quietly(mark: DedupeMark, task_id: str) -> bool:
    """Remove ``mark`` if it is ``task_id``'s; False if not, or if Redis failed (logged)."""
    try:
        return mark.clear(task_id)
    except BackendError as exc:
        logger.warning(
            "celery_redsem: could not clear the dedupe mark of %r for %s (it ends with its "
            "lease): %s",
            mark.name,
            task_id,
            exc,
        )
        return False


def end_duplicate(
    task: Task[Any, Any], request: Context, sem: FairSemaphore, other: str, *, raise_it: bool
) -> None:
    """End the run ``request`` that the run ``other`` of its key makes a duplicate: skipped
    (:func:`~celery_redsem.integration.busy.skipped`, ``reason="duplicate"``), or with
    ``raise_it`` (``dedupe="raise"``) failed with :class:`~celery_redsem.AlreadyQueued`. A grant
    the worker's main process handed it, if any, goes back."""
    if not request.is_eager:
        release_quietly(sem, permit_id_of(request))
    if raise_it:
        raise AlreadyQueued(
            f"task {task.name}[{request.id}] did not run: run {other} of {sem.name!r} is "
            "queued or running (dedupe='raise')",
            name=sem.name,
            task_id=other,
        )
    args = tuple(request.args or ())
    skipped(task, request.id, sem.name, "duplicate", args=args, kwargs=request.kwargs or {})
