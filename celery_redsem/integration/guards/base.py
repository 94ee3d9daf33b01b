"""What every guard is, and where a guarded task keeps its guards.

A guard is what one decorator (``@with_semaphore``, ``@with_lock``, ``@with_rate_limit``) made of
one task function: :class:`Guard` holds what they share (the key, the wait budget) and the few
calls the worker side makes of any guard. Each decorator's wrapper of the task's ``run``
carries its guard under :data:`GUARD_ATTR`; :func:`guards_of` finds them, outermost first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar, overload

from celery import Celery, Task

from celery_redsem.core.validation import seconds_rule
from celery_redsem.integration.guards.naming import KeyFunction, KeyNaming

__all__ = ["GUARD_ATTR", "Guard", "guards_of", "iter_guarded_tasks"]

#: The attribute of a guarded function that holds its guard.
GUARD_ATTR = "__redsem_guard__"
#: Wrappers looked through at most, outermost first.
_MAX_DEPTH = 16
_MAX_WAIT = seconds_rule(inf_ok=True)

G = TypeVar("G", bound="Guard")


class Guard:
    """The key and wait budget of one decorated task function, and what the worker asks of it.

    ``kind`` tells admission how to admit a run at dispatch: ``"permit"`` (a semaphore's) or
    ``"rate"`` (a rate limiter's booked start).
    """

    kind: ClassVar[str]

    def __init_subclass__(cls, *, kind: str, **options: Any) -> None:
        super().__init_subclass__(**options)
        cls.kind = kind

    #: What a run does when its key is busy (only a semaphore's can be other than "wait").
    on_busy: str = "wait"
    #: ``dedupe=`` (only a semaphore's can be set).
    dedupe: bool | str = False
    #: The guard's own permit lease in seconds (only a semaphore's can be set).
    lease: float | None = None

    def __init__(
        self, fn: Callable[..., Any], key: str | KeyFunction, max_wait: float | None
    ) -> None:
        self.fn = fn
        self.where = getattr(fn, "__qualname__", repr(fn))
        self.key = key
        self.naming = KeyNaming(fn, key, self.where)
        self.signature = self.naming.signature
        self.max_wait: float | None = (
            None if max_wait is None else _MAX_WAIT.check(max_wait, f"max_wait of {self.where}")
        )

    def name_for(self, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The semaphore (or limiter) name for one call (``args`` as the function gets them)."""
        return self.naming.name_for(task_name, args, kwargs)

    def max_wait_for(self, app_max_wait: float | None) -> float | None:
        """This guard's wait budget in seconds, its own or else the app's ``redsem_max_wait``
        (None: no cap)."""
        max_wait = self.max_wait if self.max_wait is not None else app_max_wait
        return None if max_wait is None or math.isinf(max_wait) else max_wait

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the function under this guard."""
        raise NotImplementedError

    def release_run(self, task: Task[Any, Any], request: Any) -> bool:
        """Give up what the run ``request`` holds of this guard, from the worker's main process
        (its child is gone, or it was revoked); whether it held something."""
        return False

    def give_back_grant(
        self, task: Task[Any, Any], request: Any, call: tuple[tuple[Any, ...], Mapping[str, Any]]
    ) -> bool:
        """Give back a grant the worker's main process handed this run for this guard, before
        the run leaves without its body (another guard retries it); whether there was one."""
        return False


@overload
def guards_of(task: object) -> list[Guard]: ...
@overload
def guards_of(task: object, kind: type[G]) -> list[G]: ...
def guards_of(task: object, kind: type[Any] = Guard) -> list[Any]:
    """The guards of class ``kind`` (default: all) on ``task``'s ``run`` (outermost first)."""
    found: list[Any] = []
    fn: object = getattr(task, "run", None)
    fn = getattr(fn, "__func__", fn)
    for _ in range(_MAX_DEPTH):
        if fn is None:
            break
        guard = getattr(fn, "__dict__", {}).get(GUARD_ATTR)
        if isinstance(guard, kind) and guard not in found:
            found.append(guard)
        fn = getattr(fn, "__wrapped__", None)
    return found


def iter_guarded_tasks(app: Celery) -> Iterator[tuple[Task[Any, Any], list[Guard]]]:
    """Every registered task of ``app`` that carries a guard, with its guards."""
    for task in list(app.tasks.values()):
        guards = guards_of(task)
        if guards:
            yield task, guards
