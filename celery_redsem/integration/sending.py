"""The send side of ``dedupe=``: a guarded task's ``apply_async`` that takes the mark first.

Celery's ``before_task_publish`` signal cannot change what a send returns (and its receivers'
errors are only logged), so the task's own ``apply_async`` is wrapped, on the task instance
that the app registered. ``delay()``, ``apply_async()``, canvas (a signature calls the
registered task's ``apply_async``), beat (so does the scheduler) and ``self.retry()`` all go
through it. :func:`install_dedupe` wraps an app's tasks; it runs when an app is finalized
(``@app.task`` and ``@shared_task`` tasks imported before that, as Celery's autodiscovery
does), at ``worker_init`` and at ``beat_init``. A task registered on an app that was already
finalized is wrapped at the next of these, or by calling :func:`install_dedupe` yourself.

``app.send_task("name", ...)`` does not go through the task: it queues the message without a
mark, and the run de-duplicates as it starts instead (see
:mod:`~celery_redsem.integration.dedupe`): it ends as a duplicate if another run has the mark.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task
from celery._state import connect_on_app_finalize
from celery.signals import beat_init
from celery.utils import uuid

from celery_redsem.core.errors import AlreadyQueued, BackendError
from celery_redsem.integration.config import get_config
from celery_redsem.integration.dedupe import clear_quietly, mark_of, queued_ttl
from celery_redsem.integration.naming import call_arguments
from celery_redsem.integration.task_guard import TaskGuard, iter_guarded_tasks

__all__ = ["install_dedupe", "watch_apps"]

logger = logging.getLogger(__name__)

_WRAPPED = "_redsem_dedupe_wrapped"


def install_dedupe(app: Celery) -> int:
    """Wrap ``apply_async`` of every task of ``app`` with a ``dedupe=`` guard (once each);
    how many were wrapped now."""
    wrapped = 0
    for task, guards in iter_guarded_tasks(app):
        guard = next((g for g in guards if g.dedupe), None)
        if guard is not None and not task.__dict__.get(_WRAPPED):
            _wrap(task, guard)
            wrapped += 1
    return wrapped


def _wrap(task: Task[Any, Any], guard: TaskGuard) -> None:
    original = task.apply_async

    def apply_async(
        args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        config = get_config(task.app)
        name = guard.name_for(task.name, call_arguments(task, args), kwargs or {})
        task_id = task_id or uuid()
        mark = mark_of(task.app, name, config)
        try:
            holder = mark.take(task_id, queued_ttl(config, options))
        except BackendError as exc:  # the run checks again as it starts
            logger.warning(
                "celery_redsem: could not check the dedupe mark of %r sending %s[%s], sent "
                "anyway (the run checks as it starts): %s",
                name,
                task.name,
                task_id,
                exc,
            )
            holder = task_id
        if holder != task_id:
            if guard.dedupe == "raise":
                raise AlreadyQueued(
                    f"task {task.name} was not sent: run {holder} of {name!r} is queued or "
                    "running (dedupe='raise')",
                    name=name,
                    task_id=holder,
                )
            logger.debug("celery_redsem: %s for %r is run %s already", task.name, name, holder)
            return task.AsyncResult(holder)
        try:
            return original(args, kwargs, task_id=task_id, **options)
        except BaseException:
            clear_quietly(mark, task_id)  # never sent: the key is free again
            raise

    setattr(task, "apply_async", apply_async)  # noqa: B010 (mypy: a method)
    setattr(task, _WRAPPED, True)


def _after_finalize(sender: Any = None, **_: Any) -> None:
    if isinstance(sender, Celery):
        install_dedupe(sender)


def _on_finalize(app: Celery) -> None:
    # Called as the app starts finalizing, before it makes its pending tasks: wrap them once
    # it has.
    app.on_after_finalize.connect(_after_finalize, weak=False, dispatch_uid=__name__)


def _on_beat_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if isinstance(app, Celery):
        install_dedupe(app)


_watching = False


def watch_apps() -> None:
    """Wrap the dedupe tasks of every app as it is finalized, and at ``beat_init`` (once per
    process; the decorators call it for a task with ``dedupe=``)."""
    global _watching  # noqa: PLW0603
    if _watching:
        return
    connect_on_app_finalize(_on_finalize)
    beat_init.connect(_on_beat_init, weak=False, dispatch_uid=f"{__name__}.beat_init")
    _watching = True
