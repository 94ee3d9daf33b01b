"""Standbys: the next task of a busy semaphore, waiting in a spare pool slot for the release.

When a holder's run ends, its child releases the permit, and the next task parked in the
worker's main process can only ask for it once the main process has heard of that end: a
release, a result through the pool, an ask and a dispatch in a row, several times the
round trip itself on a busy host, and a deep line pays it on every task.

So the first task in line of a busy semaphore may instead go to a spare pool slot ahead of its
turn, as a *standby*: its child joins the line there and waits for the wake-up that the
release pushes to it (:func:`~celery_redsem.integration.line.wait_in_slot`), and the
permit passes from one child to the next in two round trips, with no message in between.

A standby takes a slot only if another one stays free for tasks of other keys, only while the
line moves (a run of its semaphore ended here within about two hold times of its task: a
holder that keeps its permit for long, or one outside this worker, leaves the next task
parked, not waiting in a slot), only when its turn is near (first in line within one round of
permits, and a wait its child would wait for:
:func:`~celery_redsem.integration.policy.head_wait_budget`), and one at a time per semaphore
in each worker: a new one is taken when a run of that semaphore ends here, by which time the
last one got its permit (or, if the permit went to a standby of another worker, took its place
nearer the head).

A standby's message is acknowledged when its child gets the permit, not when the child takes
the task (:class:`GrantNotices`): until then the task has not started, and if the worker dies
the broker delivers it again, as it does a parked task. (Celery acknowledges a task as its
child starts it; so is a standby, as its child starts its body.) A task with ``acks_late`` is
acknowledged when it ends, as always.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from celery_redsem.integration.policy import head_wait_budget
from celery_redsem.integration.wire import open_grant_notices

__all__ = ["GrantNotices", "Standbys"]

#: Semaphores whose last release here is remembered, at most (the least recent are forgotten).
_MAX_NAMES = 10_000


class Standbys:
    """The standby of each busy semaphore in one worker (at most one each)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Any] = {}
        self._released_at: OrderedDict[str, float] = OrderedDict()  # monotonic

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def wanted(
        self,
        name: str,
        *,
        position: int,
        limit: int,
        hold: float | None,
        head_wait: float,
        free_slots: int,
    ) -> bool:
        """Whether a task at ``position`` in the line of ``name`` should wait in a pool slot
        (its own, taken already) when ``free_slots`` other slots are free; ``hold``: how long
        its task holds a permit (None: not known yet)."""
        released_at = self._released_at.get(name)
        return (
            hold is not None
            and released_at is not None
            and time.monotonic() - released_at <= 2 * hold
            and name not in self._by_name
            and free_slots >= 1
            and position <= limit
            and head_wait_budget(
                position=position, limit=limit, hold_estimate=hold, head_wait=head_wait
            )
            > 0
        )

    def add(self, name: str, req: Any) -> None:
        """``req`` went to the pool as the standby of ``name``."""
        self._by_name[name] = req

    def released(self, name: str) -> None:
        """A run of ``name`` ended here: its standby (if any) had its turn."""
        self._by_name.pop(name, None)
        self._released_at.pop(name, None)
        self._released_at[name] = time.monotonic()
        if len(self._released_at) > _MAX_NAMES:
            self._released_at.popitem(last=False)


class GrantNotices:
    """How standbys tell the worker they got their permits; the worker then acknowledges their
    messages. Children of a prefork pool (and threads) write to a pipe the event loop reads;
    where tasks run in greenlets of the worker's own thread, a task's greenlet hands the notice
    to the dispatcher (``in_loop``)."""

    def __init__(self, in_loop: Callable[..., None] | None = None) -> None:
        self._expecting: dict[str, Any] = {}
        self._partial = b""
        self._read_fd: int | None = None
        if in_loop is None:
            self._read_fd = open_grant_notices()
        else:
            open_grant_notices(lambda task_id: in_loop(self._granted, task_id))

    def expect(self, hub: Any, req: Any) -> None:
        """Acknowledge ``req`` (its ack held back) when its run tells of its grant."""
        self._expecting[req.id] = req
        fd = self._read_fd
        if fd is not None and hub.readers.get(fd) is None:  # (a reconnection resets the hub)
            hub.add_reader(fd, self._on_readable)

    def done(self, req: Any) -> None:
        """``req`` ended (with or without a grant): nothing more to expect."""
        task_id: str = req.id
        if self._expecting.get(task_id) is req:
            del self._expecting[task_id]

    def _granted(self, task_id: str) -> None:
        req = self._expecting.pop(task_id, None)
        if req is not None:
            req.redsem_ack()

    def _on_readable(self, *_: Any) -> None:
        assert self._read_fd is not None
        try:
            data = self._partial + os.read(self._read_fd, 65536)
        except BlockingIOError:
            return
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self._granted(line.decode(errors="replace"))
