"""The worker's hooks: what a worker with guarded tasks sets up at ``worker_init``.

The decorators connect :func:`on_worker_init` to ``worker_init`` as they make a guarded task
(the worker side loads only then). For an app with guarded tasks it:

* stops the worker at once when no usable Redis is set (:func:`.start_checks.refuse_without_redis`);
* gives each guarded task a :class:`~.request.ReleasingRequest`, which frees the permit of a run
  whose pool child is gone;
* adds the :class:`AdmissionStep` bootstep (``redsem_worker_admission``), which hooks admission
  into the worker's dispatch once its pool is made, and the
  :class:`~.start_checks.StartChecks` bootstep, which logs the start-up warnings;
* connects ``task_revoked`` (a task revoked before it ran gives up its place in line) and
  ``task_received`` (a ``dedupe`` task's message takes its mark as it arrives: see
  :func:`~celery_redsem.integration.dedupe.sender.mark_received`);
* wraps the ``dedupe`` tasks' sends (tasks this worker sends take their marks).

Warm shutdown needs nothing: running tasks finish and release in the child; tasks parked by
admission or waiting with a countdown keep their place and come back after redelivery.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task, bootsteps
from celery.signals import task_received, task_revoked

from celery_redsem.integration import seam
from celery_redsem.integration.admission.dispatcher import Admission
from celery_redsem.integration.dedupe.sender import install_dedupe, mark_received
from celery_redsem.integration.guards.base import iter_guarded_tasks
from celery_redsem.integration.settings import (
    defer_setting_warnings,
    expect_concurrency,
    get_config,
)
from celery_redsem.integration.worker.request import (
    has_child_processes,
    install_request_class,
    release_task,
    set_pool,
)
from celery_redsem.integration.worker.start_checks import (
    GreenEventsCheck,
    StartChecks,
    refuse_without_redis,
)

__all__ = ["AdmissionStep", "PendingAcks", "on_worker_init"]

logger = logging.getLogger(__name__)


class AdmissionStep(bootsteps.Step):
    """Hooks admission into the worker's dispatch once its pool is made (the pool's slots are
    what admission gives out); a worker whose Celery internals are not as admission expects
    runs without it, and says why as it starts."""

    label = "celery_redsem admission"
    requires = ("celery.worker.components:Pool",)

    def create(self, parent: Any) -> None:
        if isinstance(getattr(parent, "redsem_admission", None), Admission):
            return
        problems = seam.probe(parent)
        if problems:
            warning = (
                "celery_redsem: worker admission is off: this worker's internals are not as it "
                f"expects ({'; '.join(problems)}; {seam.versions()}). Guarded tasks still run "
                "within their limits, asking for permits in their pool children (waiting tasks "
                "take pool slots and retry through the broker). Please report this with the "
                "versions named."
            )
            parent.redsem_start_warnings = [*getattr(parent, "redsem_start_warnings", []), warning]
            return
        parent.redsem_admission = Admission(parent, parent.app)


class PendingAcks(bootsteps.StartStopStep):
    """A consumer step that runs, as the worker stops and before its connection closes, what
    admission left queued for its loop's next turn: acknowledgements of tasks that started as
    the stop came (else the broker gets those messages back and the tasks run twice)."""

    label = "celery_redsem acks"
    requires = ("celery.worker.consumer.connection:Connection",)

    def stop(self, parent: Any) -> None:
        admission = getattr(parent.controller, "redsem_admission", None)
        if isinstance(admission, Admission):
            admission.wiring.run_pending()

    shutdown = stop


def on_worker_init(controller: Any) -> None:
    """Set up a worker (a ``WorkController``) whose app has guarded tasks (see above)."""
    app: Celery | None = getattr(controller, "app", None)
    if app is None:
        return
    guarded = [task for task, _guards in iter_guarded_tasks(app)]
    if not guarded:
        return
    defer_setting_warnings(app)  # StartChecks logs them once the worker's logging is set up
    pool_cls = getattr(controller, "pool_cls", None)
    if not has_child_processes(pool_cls):  # threads, gevent, eventlet: tasks share a client
        expect_concurrency(app, int(getattr(controller, "concurrency", 0) or 0))
    refuse_without_redis(app, guarded)
    set_pool(pool_cls)
    for task in guarded:
        install_request_class(task)
    if get_config(app).worker_admission:
        app.steps["worker"].add(AdmissionStep)
        app.steps["consumer"].add(PendingAcks)
    install_dedupe(app)  # tasks this worker sends take their dedupe marks
    app.steps["worker"].add(StartChecks)  # before the worker builds its blueprint from them
    app.steps["consumer"].add(GreenEventsCheck)  # (says nothing but on gevent and eventlet)
    task_revoked.connect(_on_task_revoked, weak=False, dispatch_uid=f"{__name__}.task_revoked")
    task_received.connect(_on_task_received, weak=False, dispatch_uid=f"{__name__}.received")


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if terminated or request is None or not isinstance(sender, Task):
        return  # a terminated task is released in its child, or on Terminated
    release_task(sender, request)


def _on_task_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    if request is not None:
        mark_received(request)
