"""Which tasks admission decides for, its pause after a Redis error, and slow key functions.

:class:`Gate` picks the one guard of a task that admission asks for in the worker's main
process (:mod:`.dispatcher`); every other task goes straight to its pool child, which asks,
waits or retries there (:mod:`~celery_redsem.integration.guards.contention`).
After a Redis error it lets every task through for :data:`PAUSE_AFTER_ERROR` seconds, doubling
with each error in a row up to :data:`MAX_PAUSE_AFTER_ERROR`: a Redis that hangs (rather than
refuses) would cost each ask a socket timeout in the event loop. A task whose key function
is too slow for the worker's main process is left to its pool children from then on
(:class:`SlowKeyFunctions`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery_redsem.core.errors import BackendError
from celery_redsem.integration.guards.base import Guard, guards_of
from celery_redsem.integration.wire import is_duplicate

__all__ = [
    "MAX_PAUSE_AFTER_ERROR",
    "PAUSE_AFTER_ERROR",
    "RETRY_SLOW_AFTER",
    "SLOW_CALLS_IN_ROW",
    "SLOW_KEY_FUNCTION",
    "Gate",
    "SlowKeyFunctions",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds admission hands every task straight to the pool after a Redis error, doubling
#: with each error in a row up to :data:`MAX_PAUSE_AFTER_ERROR`.
PAUSE_AFTER_ERROR = 5.0
MAX_PAUSE_AFTER_ERROR = 60.0


class Gate:
    """The guard admission asks for, per task, and the pause after Redis errors."""

    def __init__(self) -> None:
        self.paused_until = 0.0
        self.paused_at = 0.0  # when the latest pause began
        self._errors_in_row = 0  # Redis errors since admission last got an answer
        self.slow_keys = SlowKeyFunctions()  # tasks whose key function is too slow for here

    def guard_of(self, req: Any) -> Guard | None:
        """The one guard of ``req``'s task if admission decides for it, else None."""
        if time.monotonic() < self.paused_until:
            return None
        task = getattr(req, "task", None)
        if task is None or task.name in self.slow_keys:
            return None
        guards = guards_of(task)
        if len(guards) != 1 or req.revoked():
            return None
        if guards[0].on_busy != "wait":
            return None  # one try, never parked: its child asks, then runs, skips or fails
        if is_duplicate(req.request_dict):
            return None  # ends at once in its child as a duplicate of the run with the mark
        return guards[0]

    def answered(self) -> None:
        """Redis answered: the next error pauses for :data:`PAUSE_AFTER_ERROR` again."""
        self._errors_in_row = 0

    def pause(self, exc: BackendError) -> None:
        """Hand every task straight to the pool for a while after a Redis error."""
        pause = min(MAX_PAUSE_AFTER_ERROR, PAUSE_AFTER_ERROR * 2.0**self._errors_in_row)
        self._errors_in_row += 1
        self.paused_at = time.monotonic()
        self.paused_until = self.paused_at + pause
        logger.warning(
            "celery_redsem: admission paused for %.0fs after a Redis error: %s", pause, exc
        )


#: A key function call that takes longer than this (seconds) in the worker's main process,
#: where it holds up every other task's dispatch, counts as slow.
SLOW_KEY_FUNCTION = 0.05
#: Slow calls in a row after which a task's key function is left to its pool children. One is
#: not enough: on a loaded host a trivial lambda took 79 ms among 20 busy threads, and the
#: task lost admission for good (its tasks went round the broker as retries).
SLOW_CALLS_IN_ROW = 3
#: Seconds after which a task left to its pool children is tried again, in a thread.
RETRY_SLOW_AFTER = 60.0


class SlowKeyFunctions:
    """The tasks whose key function is too slow for the worker's main process.

    A call admission has not seen come back quickly for a task name (its first, or the first
    after the name was left to the pool children) runs in a thread of its own, waited for at
    most :data:`SLOW_KEY_FUNCTION`: a key function that is slow at first (a cache to fill, a
    database to reach) costs the worker's dispatch that much, not its whole run (a 30 s one
    held up every other task for 30 s). Later calls run where admission runs, timed.
    :data:`SLOW_CALLS_IN_ROW` slow calls in a row leave the task to its pool children, for
    :data:`RETRY_SLOW_AFTER` seconds at a time.
    """

    def __init__(self) -> None:
        self._left_at: dict[str, float] = {}  # names left to the pool children, since
        self._in_row: dict[str, int] = {}  # slow calls in a row
        self._quick: set[str] = set()  # a call in a thread came back in time

    def __contains__(self, task_name: object) -> bool:
        left_at = self._left_at.get(task_name)  # type: ignore[call-overload]
        return left_at is not None and time.monotonic() - left_at < RETRY_SLOW_AFTER

    def call(self, task_name: str, fn: Callable[[], T]) -> T | None:
        """``fn()`` (a key and limit function's call) for ``task_name``; None if it is too
        slow for here (its task asks in its pool child). Exceptions come through."""
        if task_name in self._quick:
            started = time.monotonic()
            try:
                return fn()
            finally:
                self.timed(task_name, time.monotonic() - started)
        outcome: list[tuple[bool, Any]] = []
        done = threading.Event()

        def call_in_thread() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as exc:  # (handed to the caller below)
                outcome.append((False, exc))
            finally:
                done.set()

        started = time.monotonic()
        threading.Thread(target=call_in_thread, name="redsem-key-call", daemon=True).start()
        if not done.wait(SLOW_KEY_FUNCTION):
            self.timed(task_name, time.monotonic() - started, still_running=True)
            return None
        self._quick.add(task_name)
        self._in_row.pop(task_name, None)
        if self._left_at.pop(task_name, None) is not None:
            logger.info(
                "celery_redsem: the key function of %s is quick again; admission decides "
                "for it in the worker's main process again.",
                task_name,
            )
        ok, value = outcome[0]
        if not ok:
            raise value
        result: T = value
        return result

    def timed(self, task_name: str, took: float, *, still_running: bool = False) -> None:
        """Count a call of ``task_name``'s key function that took ``took`` seconds (or is
        ``still_running`` after them); :data:`SLOW_CALLS_IN_ROW` slow ones in a row leave the
        task to its pool children (in the main process they hold up every dispatch)."""
        if not still_running and took <= SLOW_KEY_FUNCTION:
            self._in_row.pop(task_name, None)
            return
        in_row = self._in_row[task_name] = self._in_row.get(task_name, 0) + 1
        if in_row < SLOW_CALLS_IN_ROW and task_name not in self._left_at:
            return
        again = task_name in self._left_at
        self._left_at[task_name] = time.monotonic()
        self._quick.discard(task_name)  # (tried again in a thread)
        if again:
            return
        logger.warning(
            "celery_redsem: the key function of %s took %s%.3fs in the worker's main "
            "process (%d slow calls in a row), where it holds up the dispatch of every task; "
            "%s asks for its permit in its pool child for the next %.0fs, and then as long as "
            "its key function stays slow. Make the key a quick function of the arguments "
            "(no database or network calls) to keep admission at dispatch.",
            task_name,
            "over " if still_running else "",
            took,
            in_row,
            task_name,
            RETRY_SLOW_AFTER,
        )
