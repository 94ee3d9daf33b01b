"""De-duplication (``dedupe=True`` or ``"raise"``): one run per key queued or running at a time.

The mark (:class:`~celery_redsem.core.marks.DedupeMark`) is taken when the task is sent
(:mod:`~celery_redsem.integration.dedupe.sender`), under the name the run will compute: the task's
key
function over the arguments sent. A send that finds another live run's mark gets that run's
``AsyncResult`` back (``"raise"``: :class:`~celery_redsem.AlreadyQueued`) and queues nothing.

The run keeps the mark (:class:`RunMark`): it claims it again as it starts (a message that came
by another way and was not checked on receipt still takes it or, if another run has it, ends as
a duplicate), then, once it holds its permit, ties it to the permit: from then on the mark
counts only while the permit's lease (which the heartbeat renews) has not ended, so a lost
worker frees the key within a lease. It is cleared on every way the run ends (success, failure,
skip; revoke, expiry and a lost child from the worker's main process), but kept across a retry
(the same task id comes back). A queued run's mark lives for ``redsem_dedupe_lease`` seconds
from its send (plus the send's countdown or ETA), so a lost message cannot block the key for
longer; a running run renews its mark's TTL every third of it (:class:`MarkKeeper`), so a run
longer than ``redsem_dedupe_lease`` keeps it.

A message that did not take the mark as it was sent (``send_task`` by name, a step of a canvas
sent while another run had the mark) takes it when it reaches a worker
(:func:`~celery_redsem.integration.dedupe.sender.mark_received`, in the worker's main process): if
another live run has it then, the request carries
:data:`~celery_redsem.integration.wire.DUPLICATE_FIELD` and the run ends as
a duplicate when it starts, whatever happened meanwhile, as a send would have decided.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import Celery, Task
from celery.app.task import Context
from celery.exceptions import Ignore

from celery_redsem.core.errors import AlreadyQueued, BackendError
from celery_redsem.core.marks import DedupeMark
from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.core.validation import Rule
from celery_redsem.integration.guards.endings import skipped
from celery_redsem.integration.line import release_quietly
from celery_redsem.integration.settings import RedsemConfig, get_client, get_config
from celery_redsem.integration.wire import take_duplicate_of

__all__ = [
    "DEDUPE",
    "MarkKeeper",
    "RunMark",
    "clear_quietly",
    "end_duplicate",
    "mark_of",
    "queued_ttl",
]

logger = logging.getLogger(__name__)

#: ``dedupe=``: off, on (a repeated send gets the queued run's result), raise, or coalesce
#: (newest wins: :mod:`~celery_redsem.integration.dedupe.coalesce`).
DEDUPE = Rule(
    "False, True, 'raise' or 'coalesce'", lambda value: value in (False, True, "raise", "coalesce")
)


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
        self.permit_id: str | None = None

    def claim(self, request: Context) -> str | None:
        """Take the mark as the run starts: None if this run has it, else the id of the run
        that does (this one is a duplicate, or was found to be one as its message reached the
        worker). If Redis fails the run goes on (logged): the permit still limits it."""
        other = self.claim_on_receipt(request)
        if other is not None:
            return other
        try:
            holder = self.mark.claim(self.task_id, self.ttl)
        except BackendError as exc:
            logger.warning(
                "celery_redsem: could not check the dedupe mark of %r for run %s: %s",
                self.mark.name,
                self.task_id,
                exc,
            )
            return None
        return None if holder == self.task_id else holder

    def claim_on_receipt(self, request: Context) -> str | None:
        """The id of the run that the worker's main process found had the mark as this run's
        message reached it, if another's (this run is a duplicate)."""
        other = take_duplicate_of(request)
        return other if other is not None and other != self.task_id else None

    def hold(self, permit_id: str) -> None:
        """Tie the mark to the run's permit, and renew it while the run goes on (best effort:
        a failure is logged)."""
        self.permit_id = permit_id
        try:
            self.mark.hold(self.task_id, permit_id, self.ttl)
        except BackendError as exc:
            logger.warning("celery_redsem: could not keep the dedupe mark of %r: %s", self, exc)
        _keeper.add(self)

    def take_over(
        self,
        task: Task[Any, Any],
        request: Context,
        sem: FairSemaphore,
        permit: Permit,
        call: tuple[tuple[Any, ...], dict[str, Any]],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments the body runs with, holding ``permit``: ``call`` itself (a coalesced
        run's may be newer: :class:`~celery_redsem.integration.dedupe.coalesce.CoalesceRun`)."""
        return call

    def renew(self) -> bool:
        """Push the TTL of the mark (the keeper calls this); False once it is no longer this
        run's. A Redis failure is logged, and the next renewal tries again."""
        try:
            return self.mark.keep(self.task_id, self.permit_id or "", self.ttl)
        except BackendError as exc:
            logger.warning("celery_redsem: could not renew the dedupe mark of %r: %s", self, exc)
            return True

    def end(self, *, clear: bool = True) -> None:
        """The run ends: stop renewing the mark, and remove it if it is still this run's (best
        effort: else it ends with its lease). A run that retried keeps it (``clear=False``):
        the same task id comes back."""
        _keeper.remove(self)
        if clear:
            clear_quietly(self.mark, self.task_id)

    def __repr__(self) -> str:
        return f"<RunMark {self.mark.name!r} {self.task_id}>"


def keep_renewing(mark: RunMark) -> None:
    """Have this process's keeper renew ``mark`` until it ends."""
    _keeper.add(mark)


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
    task: Task[Any, Any], request: Context, sem: FairSemaphore, other: str, dedupe: object
) -> None:
    """End the run ``request`` that the run ``other`` of its key makes a duplicate: skipped
    (:func:`~celery_redsem.integration.guards.endings.skipped`, ``reason="duplicate"``), or
    (``dedupe="raise"``) failed with :class:`~celery_redsem.AlreadyQueued`, or
    (``"coalesce"``) ended with Celery's ``Ignore``, storing no result: ``other`` stores it.
    A grant the worker's main process handed it, if any, goes back."""
    if not request.is_eager:
        release_quietly(sem, permit_id_of(request))
    if dedupe == "coalesce":
        raise Ignore(f"run {other} of {sem.name!r} carries its arguments and answers for it")
    raise_it = dedupe == "raise"
    if raise_it:
        raise AlreadyQueued(
            f"task {task.name}[{request.id}] did not run: run {other} of {sem.name!r} is "
            "queued or running (dedupe='raise')",
            name=sem.name,
            task_id=other,
        )
    args = tuple(request.args or ())
    skipped(task, request.id, sem.name, "duplicate", args=args, kwargs=request.kwargs or {})


class MarkKeeper:
    """Renews the marks of the runs going on in this process, each every third of its TTL, from
    one daemon thread that runs while there are any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[RunMark, float] = {}  # mark -> when it is next renewed (monotonic)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, mark: RunMark) -> None:
        with self._lock:
            self._due[mark] = time.monotonic() + mark.ttl / 3
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="celery_redsem-dedupe-keeper", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def remove(self, mark: RunMark) -> None:
        with self._lock:
            self._due.pop(mark, None)

    def __len__(self) -> int:
        return len(self._due)

    def _serve(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                if not self._due:
                    self._thread = None
                    return
                now = time.monotonic()
                due = [mark for mark, at in self._due.items() if at <= now]
                for mark in due:
                    self._due[mark] = now + mark.ttl / 3
                wait = min(self._due.values()) - now
            for mark in due:
                if not mark.renew():
                    self.remove(mark)  # cleared, or taken over: nothing of this run's to renew
            self._wake.wait(max(0.0, wait))


_keeper = MarkKeeper()


def _after_fork_in_child() -> None:
    global _keeper  # noqa: PLW0603
    _keeper = MarkKeeper()  # the parent's thread (and maybe its held lock) did not come along


os.register_at_fork(after_in_child=_after_fork_in_child)
