"""The runs of guarded tasks live in one worker's main process, as admission sees them.

Admission must know, for each permit id (a task run), whether another delivery of the same run
is being asked for or runs here: that delivery would get the same permit (acquire is
idempotent per id), and the two copies would run at once. :class:`LiveRuns` keeps the
requests whose ask is in flight and those handed to the pool with a grant, and watches each
granted run's end: it learns the task's hold time and tells admission (``on_end``), which
wakes a task parked on the freed semaphore.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.integration.policy import hold_times
from celery_redsem.integration.seam import live_request, live_requests

__all__ = ["LiveRuns"]


class LiveRuns:
    """Guarded runs being asked for or running in this worker, by permit id.

    ``on_end(name, run)`` is called when a run granted a permit of semaphore ``name`` here
    ends, whichever way it ends.
    """

    def __init__(
        self,
        on_end: Callable[[str, str], None],
        in_loop: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._on_end = on_end
        #: How a run's end (reported by the pool, maybe in a thread of its own) gets to the
        #: worker's event loop, where everything here runs (None: it is there already).
        self._in_loop = in_loop
        self._asking: dict[str, list[Any]] = {}  # asks in flight
        self._handed: dict[str, list[Any]] = {}  # handed to the pool with a grant, not ended

    # -- asks in flight ------------------------------------------------------------------------

    def asking(self, run: str, req: Any) -> None:
        """``req``'s ask for run ``run``'s permit went out."""
        self._asking.setdefault(run, []).append(req)

    def answered(self, run: str, req: Any) -> None:
        """``req``'s ask was answered (or failed)."""
        _remove(self._asking, run, req)

    # -- runs handed over ----------------------------------------------------------------------

    def runs_here(self, req: Any, run: str) -> bool:
        """Whether another delivery of ``req``'s run (``run``: its permit id) is being asked
        for or runs on this worker now (the broker delivered it again, say after a lost
        connection, while the first delivery goes on)."""
        if any(r is not req for r in self._asking.get(run, ())):
            return True
        handed = [r for r in self._handed.get(run, ()) if r is not req and live_request(r)]
        if handed:
            return True
        self._handed.pop(run, None)  # ended without telling us (never ran), if any are left
        return any(
            r.id == req.id and r is not req and permit_id_of(r) == run for r in live_requests()
        )

    def handed_here(self, run: str) -> bool:
        """Whether a delivery of run ``run`` went to the pool here with a grant, not ended."""
        return any(live_request(r) for r in self._handed.get(run, ()))

    def handed(
        self, req: Any, name: str, *, learn: bool = True, then: Callable[[], None] | None = None
    ) -> None:
        """``req`` goes to the pool with a permit of semaphore ``name`` (or, as a standby, to
        wait for one there): watch for its end (``learn``: its time is a hold time; ``then``
        is called first when it ends).

        The pool calls the request's ``on_success`` or ``on_failure`` bound when it is handed
        over, so wrapping them on the instance sees every end.
        """
        started = time.monotonic()
        task_name = req.task.name
        run = permit_id_of(req)
        self._handed.setdefault(run, []).append(req)
        done = False

        def finished() -> None:
            nonlocal done
            if not done:
                done = True
                if then is not None:
                    then()
                _remove(self._handed, run, req)
                if learn:
                    hold_times.observe(task_name, time.monotonic() - started)
                self._on_end(name, run)

        def wrap(callback: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                try:
                    return callback(*args, **kwargs)
                finally:
                    if self._in_loop is None:
                        finished()
                    else:
                        self._in_loop(finished)

            return wrapped

        req.on_success = wrap(req.on_success)
        req.on_failure = wrap(req.on_failure)


def _remove(by_run: dict[str, list[Any]], run: str, req: Any) -> None:
    reqs = by_run.get(run, [])
    if req in reqs:
        reqs.remove(req)
    if not reqs:
        by_run.pop(run, None)
