"""Permit ids: random ones that are unique across processes and cheap to make, and those
of Celery task runs.

A random id is this process's random 96-bit prefix followed by a counter in hex. Making one needs
no system call, which matters because the acquire path runs on every task start; a random
id per call (``os.urandom`` or ``uuid4``) costs a ``getrandom`` each time. A forked child
(a prefork pool worker) draws its own prefix before it runs anything, so parent and child
never hand out the same id. A task run's id is its task id, marked when the task's own
retry or a replace queued the run (:func:`run_permit_id`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from typing import Any

__all__ = ["MAX_PERMIT_ID_LENGTH", "new_permit_id", "permit_id_of", "run_permit_id"]

#: The longest permit id a semaphore takes (its keys and replies stay small).
MAX_PERMIT_ID_LENGTH = 256
RUN_MARK = "~"  # starts the suffix of a task run's permit id
#: Task ids that starting so are replaced by a hash (see run_permit_id).
_MAPPED = (":", "#")


class _PermitIds:
    """The process's id prefix and counter; :meth:`draw` starts a new series."""

    def __init__(self) -> None:
        self.prefix = ""
        self.counter = itertools.count()
        self.draw()

    def draw(self) -> None:
        """Take a new random prefix and restart the counter (at import and after a fork)."""
        self.prefix = os.urandom(12).hex()
        self.counter = itertools.count()

    def next(self) -> str:
        """A permit id no other call, thread or process gets."""
        return self.prefix + format(next(self.counter), "x")


_IDS = _PermitIds()
os.register_at_fork(after_in_child=_IDS.draw)

new_permit_id = _IDS.next


def run_permit_id(task_id: str, retries: object = 0, replaced_task_nesting: object = 0) -> str:
    """The permit id of one run of a Celery task: its task id, with ``~<retries>`` (and
    ``.<replaced_task_nesting>`` if nonzero) appended for a run that the task's own retry or a
    ``replace()`` queued.

    Such a run is queued under the same task id before the body that queued it ends, so it
    must not share that body's permit: acquiring is idempotent per id, it would get the same
    grant back, and the ending run's release would free it under the new run. Redeliveries of
    one run (and its contention retries, which keep ``retries``) share its id and its permit.

    No two runs map to one id: a task id that contains ``~`` always gets the suffix (``~0``
    on its first run), so the last ``~`` always starts the suffix of a suffixed id. A task id
    that would not fit (longer than :data:`MAX_PERMIT_ID_LENGTH`), or that starts with ``:``
    (the semaphore's own fields do) or ``#`` (what the others are replaced by), is replaced by
    ``#`` and a hash of the task id.
    """
    retry_count, nesting = _count(retries), _count(replaced_task_nesting)
    if not retry_count and not nesting and RUN_MARK not in task_id:
        run_id = task_id
    else:
        run_id = f"{task_id}{RUN_MARK}{retry_count}" + (f".{nesting}" if nesting else "")
    if len(run_id) <= MAX_PERMIT_ID_LENGTH and not task_id.startswith(_MAPPED):
        return run_id
    digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()
    return "#" + digest + run_id[len(task_id) :]


def permit_id_of(request: Any) -> str:
    """:func:`run_permit_id` of a task's ``Context`` or a worker's ``Request`` (whose numbers
    are in its ``request_dict``)."""
    fields = getattr(request, "request_dict", None)
    if isinstance(fields, dict):
        retries, nesting = fields.get("retries"), fields.get("replaced_task_nesting")
    else:
        retries = getattr(request, "retries", 0)
        nesting = getattr(request, "replaced_task_nesting", 0)
    return run_permit_id(str(request.id), retries, nesting)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
