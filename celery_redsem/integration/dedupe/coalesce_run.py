"""A run of a ``dedupe="coalesce"`` task (:mod:`~celery_redsem.integration.dedupe.coalesce`):
holding its permit it takes over the pending run's newest arguments, or defers, waits its turn,
or ends absorbed; when it ends (``task_postrun``, in its child) its result or error is stored
under every id it answers for."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, Task, states
from celery.app.task import Context
from celery.exceptions import Ignore
from celery.signals import task_postrun

from celery_redsem.core.errors import BackendError
from celery_redsem.core.marks import CoalesceRecord, Debounce
from celery_redsem.core.permits import Permit
from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.integration.dedupe.coalesce import (
    CANVAS_FIELDS,
    deserialize,
    record_of,
    serialize,
    store_results,
)
from celery_redsem.integration.dedupe.run_mark import RunMark, keep_renewing
from celery_redsem.integration.guards.contention import Contention
from celery_redsem.integration.guards.naming import call_arguments
from celery_redsem.integration.line import release_quietly
from celery_redsem.integration.settings import RedsemConfig
from celery_redsem.integration.wire import read_wait

__all__ = ["CoalesceRun"]

logger = logging.getLogger(__name__)


class CoalesceRun(RunMark):
    """A run of a ``dedupe="coalesce"`` task: it takes over the pending run's newest arguments
    once it holds its permit, and answers for the sends it absorbed when it ends."""

    def __init__(
        self, app: Celery, name: str, task_id: str, config: RedsemConfig, debounce: Debounce
    ) -> None:
        super().__init__(app, name, task_id, config)
        self.record: CoalesceRecord = record_of(app, name, config)
        self.mark = self.record  # type: ignore[assignment] # (renewed as a mark is)
        self.debounce = debounce
        self.config = config

    def claim(self, request: Context) -> str | None:
        """Only what the main process found (absorbed on receipt); all else is decided by
        :meth:`take_over`. The run's end is answered for in ``task_postrun``."""
        _runs[self.task_id] = self
        return super().claim_on_receipt(request)

    def hold(self, permit_id: str) -> None:
        """Nothing yet: :meth:`take_over` ties the record to the permit."""

    def take_over(
        self,
        task: Task[Any, Any],
        request: Context,
        sem: FairSemaphore,
        permit: Permit,
        call: tuple[tuple[Any, ...], dict[str, Any]],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Holding ``permit``: the arguments the body runs with (``call`` or the newest);
        raises Celery's ``Retry`` (not due yet, another run's turn, or Redis failed: as a
        contention retry) or ``Ignore`` (absorbed), having released the permit."""
        if request.is_eager or request.called_directly:
            return call
        started = time.monotonic()
        what = f"its turn on {sem.name!r}"
        ask = Contention(task, request, sem.name, what, None, self.config)
        try:
            arguments = serialize(task, request.args, request.kwargs, sem.name)
            canvas = any(getattr(request, f, None) for f in CANVAS_FIELDS)
            decided = self.record.start(
                self.task_id, permit.id, arguments, self.ttl, self.debounce, canvas=canvas
            )
        except BaseException as exc:
            release_quietly(sem, permit)
            if isinstance(exc, BackendError):  # (a repeated start answers as this one did)
                ask.retry_after_error(exc, started=started)
            raise
        if decided.status == "run":
            self.permit_id = permit.id
            keep_renewing(self)
            if decided.arguments is None:
                return call
            args, kwargs = deserialize(task.app, decided.arguments)
            return call_arguments(task, args), kwargs
        release_quietly(sem, permit)
        if decided.status == "absorbed":
            raise Ignore(f"run {decided.task_id} of {sem.name!r} answers for it")
        reason = "not due yet (debounce)" if decided.status == "defer" else "another run's turn"
        raise ask.publish_retry(decided.delay, read_wait(request), release=None, reason=reason)

    def end(self, *, clear: bool = True) -> None:
        """Stop renewing; the record is finished in ``task_postrun`` (with the result)."""
        super().end(clear=False)


#: The coalesced runs going on in this process, by task id, until their ``task_postrun``.
_runs: dict[str, CoalesceRun] = {}


def _on_postrun(
    task: Any = None, task_id: str | None = None, retval: Any = None, state: Any = None, **_: Any
) -> None:
    run = _runs.pop(task_id or "", None)
    if run is None or state not in (states.SUCCESS, states.FAILURE):
        return  # a retry comes back; an absorbed run answers for nothing
    try:
        answered = run.record.finish(run.task_id)
    except BackendError as exc:
        logger.warning(
            "celery_redsem: could not finish the coalesce record of %r for %s: %s",
            run.record.name,
            run.task_id,
            exc,
        )
        return
    store_results(task, answered, retval, state)


task_postrun.connect(_on_postrun, weak=False, dispatch_uid=f"{__name__}.postrun")
