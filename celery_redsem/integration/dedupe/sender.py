"""The send side of ``dedupe=``: a guarded task's ``apply_async`` that takes the mark first.

Celery's ``before_task_publish`` signal cannot change what a send returns (and its receivers'
errors are only logged), so the task's own ``apply_async`` is wrapped, on the task class that
Celery makes of the function. ``delay()``, ``apply_async()``, canvas (a signature calls the
registered task's ``apply_async``), beat (so does the scheduler) and ``self.retry()`` all go
through it. The class is wrapped as Celery makes it (:func:`watch_sends`): whatever sends the
task, also a process that only imports the tasks module and never finalizes its app (a web
process). :func:`install_dedupe`, run when an app is finalized, at ``worker_init`` and at
``beat_init``, catches any task made another way.

A step of a canvas (a send with a ``chain``, ``link``, ``link_error``, ``group_id``, ``chord``,
or an explicit ``parent_id`` or ``root_id`` as a worker sends a chain's next step or a callback)
already has its result object, with the id the canvas gave it, and what ``apply_async`` returns
is dropped: had it queued nothing, that result would never be ready, and no later step would
run. So it is queued, whoever has the mark, and ends as a duplicate as it starts if another run
had it (result None, and the canvas goes on; ``dedupe="raise"``: it fails with
:class:`~celery_redsem.AlreadyQueued`).

``app.send_task("name", ...)`` does not go through the task: it queues the message without a
mark. :func:`mark_received` (called by the worker's main process for every message it receives)
takes the mark for such a message, or finds it a duplicate (see
:mod:`~celery_redsem.integration.dedupe.run_mark`).

With ``dedupe="coalesce"`` both sides hand over to
:mod:`~celery_redsem.integration.dedupe.coalesce` (newest wins).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import beat_init
from celery.utils import uuid

from celery_redsem.core.errors import AlreadyQueued, BackendError
from celery_redsem.core.marks import Debounce
from celery_redsem.integration.dedupe import coalesce
from celery_redsem.integration.dedupe.run_mark import clear_quietly, mark_of, queued_ttl
from celery_redsem.integration.guards.base import Guard, guards_of, iter_guarded_tasks
from celery_redsem.integration.guards.naming import call_arguments
from celery_redsem.integration.seam import on_app_finalize, on_task_class
from celery_redsem.integration.settings import get_config
from celery_redsem.integration.wire import mark_duplicate

__all__ = ["install_dedupe", "mark_received", "watch_apps"]

logger = logging.getLogger(__name__)

_WRAPPED = "_redsem_dedupe_wrapped"
_CANVAS_OPTIONS = coalesce.CANVAS_OPTIONS  # a send with one is a step of a canvas (see above)


def install_dedupe(app: Celery) -> int:
    """Have every task of ``app`` with a ``dedupe=`` guard take its mark when sent (done as
    each task class is made; this catches any made another way); how many tasks of ``app``
    take their marks."""
    count = 0
    for task, guards in iter_guarded_tasks(app):
        guard = next((g for g in guards if g.dedupe), None)
        if guard is not None:
            wrap_sends(type(task), guard)
            count += 1
    return count


def wrap_sends(cls: type, guard: Guard) -> None:
    """Make the sends of task class ``cls`` take ``guard``'s dedupe mark first (once)."""
    if cls.__dict__.get(_WRAPPED):
        return
    original = cls.apply_async  # type: ignore[attr-defined]

    def apply_async(
        task: Any, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        name = guard.name_for(task.name, call_arguments(task, args), kwargs or {})
        if guard.dedupe == "coalesce":
            debounce = getattr(guard, "debounce", None) or Debounce()
            ttl = queued_ttl(get_config(task.app), options)
            call = (args, kwargs, task_id, options)
            return coalesce.send(task, name, call, original, debounce=debounce, ttl=ttl)
        config = get_config(task.app)
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
        if holder != task_id and any(options.get(o) for o in _CANVAS_OPTIONS):
            logger.debug(
                "celery_redsem: %s[%s] for %r queued in its canvas; run %s has the mark, so it "
                "ends as a duplicate",
                task.name,
                task_id,
                name,
                holder,
            )
        elif holder != task_id:
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
            return original(task, args, kwargs, task_id=task_id, **options)
        except BaseException:
            clear_quietly(mark, task_id)  # never sent: the key is free again
            raise

    cls.apply_async = apply_async  # type: ignore[attr-defined]
    setattr(cls, _WRAPPED, True)


def mark_received(request: Any) -> None:
    """In the worker's main process, for a message just received (``task_received``): take the
    dedupe mark for its run if free, or, if another live run has it, set
    :data:`~celery_redsem.integration.wire.DUPLICATE_FIELD` on the request so the run
    ends
    as a duplicate. A message its send marked finds its own mark (one round trip, nothing
    changed). Whatever fails here is left to the run, which claims the mark as it starts."""
    request_dict = getattr(request, "request_dict", None)
    task = getattr(request, "task", None)
    task_id = getattr(request, "id", None)
    if not isinstance(request_dict, dict) or task is None or not task_id:
        return
    guard = next((g for g in guards_of(task) if g.dedupe), None)
    if guard is None:
        return
    mark_duplicate(request_dict, None)  # only this process says so
    try:
        config = get_config(task.app)
        name = guard.name_for(task.name, call_arguments(task, request.args), request.kwargs or {})
        if guard.dedupe == "coalesce":
            debounce = getattr(guard, "debounce", None) or Debounce()
            ttl = queued_ttl(config, {"eta": request.eta})
            coalesce.receive(task, name, debounce, request, ttl)
            return
        mark = mark_of(task.app, name, config)
        holder = mark.claim(task_id, queued_ttl(config, {"eta": request.eta}))
    except BackendError as exc:
        logger.warning(
            "celery_redsem: could not check the dedupe mark of %s[%s] as it was received (the "
            "run checks as it starts): %s",
            task.name,
            task_id,
            exc,
        )
        return
    except Exception:  # a bad key function (or arguments): the run reports it as it starts
        return
    if holder != task_id:
        mark_duplicate(request_dict, holder)


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


def watch_sends(fn: Any, guard: Guard) -> None:
    """Have every task Celery makes of the guarded function ``fn`` take ``guard``'s mark when
    sent, as its class is made (and, failing that, when its app is finalized)."""
    on_task_class(fn, lambda cls: wrap_sends(cls, guard))
    watch_apps()


def watch_apps() -> None:
    """Wrap the dedupe tasks of every app as it is finalized, and at ``beat_init`` (once per
    process; the decorators call it for a task with ``dedupe=``)."""
    global _watching  # noqa: PLW0603
    if _watching:
        return
    on_app_finalize(_on_finalize)
    beat_init.connect(_on_beat_init, weak=False, dispatch_uid=f"{__name__}.beat_init")
    _watching = True
