"""Signals celery_redsem sends, for users to connect to (as Celery's own signals)::

    from celery_redsem.signals import task_skipped

    @task_skipped.connect
    def note_skip(sender, task_id, name, reason, **kwargs):
        metrics.increment(f"skipped.{sender.name}.{reason}")

Importing this imports Celery.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["task_coalesced", "task_skipped"]

#: Sent in the process that ran the task when a run ended without its body and in state
#: SUCCESS with result None: ``sender`` is the task, ``task_id`` the run's id, ``name`` the
#: semaphore name, ``reason`` ``"busy"`` (``on_busy="skip"`` found no permit free) or
#: ``"duplicate"`` (``dedupe=True``: another run of the key is queued or running), ``args``
#: and ``kwargs`` the run's arguments.
task_skipped = Signal(
    name="task_skipped",
    providing_args=["task_id", "name", "reason", "args", "kwargs"],
)

#: Sent where a send or message of a ``dedupe="coalesce"`` task was absorbed by the pending run
#: of its key (in the sending process, or in the worker's main process for a message that came
#: another way): ``sender`` is the task, ``task_id`` the pending run that carries the newest
#: arguments and answers for it, ``absorbed_id`` the absorbed message's id (None for a send
#: without a task id of its own: it got ``task_id``'s result), ``name`` the semaphore name,
#: ``debounced`` whether the task has ``debounce=`` (the send pushed the run's start back).
task_coalesced = Signal(
    name="task_coalesced",
    providing_args=["task_id", "absorbed_id", "name", "debounced"],
)
