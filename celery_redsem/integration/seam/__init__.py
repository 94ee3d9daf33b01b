"""The one seam over Celery's and kombu's private API: every private name the package uses.

Celery has no public hook at dispatch, so admission (:mod:`.admission`) has to touch private
API. All of it is here, with what it is used for; nothing else in the package names any of it:

=============================================  ===============================================
Celery / kombu                                 used for
=============================================  ===============================================
``WorkController._process_task``               admission's hook: replaced on the worker
``WorkController._process_task_sem``           tells a pool that gates dispatch by its slots;
                                               made the threads pool's dispatch (see below)
kombu ``LaxBoundedSemaphore._waiting``         the slot queue: put first, remove, claim a slot
``WorkController._quick_release``              a slot's release (Celery binds it at start)
prefork ``AsynPool.outbound_buffer``           tasks handed to the pool, not yet written
``celery._state._get_active_apps``             the app of a guarded function called directly
``celery._state.connect_on_app_finalize``      dedupe's send side, as each app is finalized
``Celery._task_from_fun`` copying the          dedupe's send side, as each task class is made
function's ``__annotations__`` into the        (also in a process that never finalizes its
task class                                     app: a web process that only sends)
``celery.worker.state`` request sets, flags    runs live in this worker, a stopping worker
kombu ``Hub._pop_ready``                       acks still queued in the event loop, sent
                                               before the worker's connection closes
kombu Redis ``cycle.maybe_restore_messages``   a dead worker's messages given back, also by a
                                               worker without an event loop
kombu Redis ``cycle.poller``,                  a worker without an event loop woken from its
``cycle.on_poll_start``, ``_paused_brpop``     poll when its prefetch window frees
                                               (:mod:`.broker_poll`)
worker ``Request._payload`` (its embed)        whether a received message is a canvas step
                                               (coalesce: its canvas goes on from it)
=============================================  ===============================================

:func:`probe` checks, as a worker starts, that what admission needs is there and behaves as
expected (a throwaway slot semaphore of the worker's own class is driven through a queue and a
release), and says what is not; admission then stays off with one warning naming the Celery
and kombu versions (:func:`versions`), and guarded tasks ask in their pool children instead.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, Protocol

from celery import Celery, bootsteps
from celery import _state as celery_state
from celery.concurrency.thread import TaskPool as ThreadsPool
from celery.worker import state as worker_state

__all__ = [
    "SlotQueue",
    "Slots",
    "active_apps",
    "call_once_when_run_ends",
    "hook_dispatch",
    "in_loop",
    "live_request",
    "live_requests",
    "message_embed",
    "on_app_finalize",
    "on_task_class",
    "probe",
    "run_pending",
    "slot_queue",
    "sweep_unacked",
    "unwritten_tasks",
    "versions",
    "worker_stopping",
]

logger = logging.getLogger(__name__)

#: A slot queue entry, as kombu keeps it: the callback, its args and its kwargs.
Entry = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]

_BLUEPRINT_RUNNING: int = bootsteps.RUN  # type: ignore[attr-defined]  # (not in the stubs)


# -- apps ------------------------------------------------------------------------------------------


def active_apps() -> list[Celery]:
    """The Celery apps alive in this process."""
    return list(celery_state._get_active_apps())  # type: ignore[attr-defined]


def on_app_finalize(callback: Callable[[Celery], None]) -> None:
    """Call ``callback(app)`` as each app of this process starts to finalize (and for those
    finalized already)."""
    celery_state.connect_on_app_finalize(callback)


def on_task_class(fn: Callable[..., Any], callback: Callable[[type], None]) -> None:
    """Call ``callback(cls)`` with every task class Celery makes of ``fn`` (``@app.task``,
    ``@shared_task``: one per app), as it makes it, whether or not the app is ever finalized.

    Celery builds a task class with ``type()``, putting the function's ``__annotations__`` in
    the class's namespace; Python calls ``__set_name__`` on every object of a new class's
    namespace that has one, so annotations that have one hear of the class.
    """
    fn.__annotations__ = _AnnotationsThatTell(fn.__annotations__, callback)


class _AnnotationsThatTell(dict[str, Any]):
    """A function's annotations that call back when a class is made with them."""

    def __init__(self, annotations: dict[str, Any], callback: Callable[[type], None]) -> None:
        super().__init__(annotations)
        self._callback = callback

    def __set_name__(self, owner: type, name: str) -> None:
        self._callback(owner)


# -- the worker's state ----------------------------------------------------------------------------


def live_request(req: Any) -> bool:
    """Whether ``req`` is still reserved or running in this worker (two set lookups: no copy
    of the worker's sets, which hold every parked task)."""
    return req in worker_state.reserved_requests or req in worker_state.active_requests


def message_embed(req: Any) -> dict[str, Any]:
    """The canvas fields (``callbacks``, ``errbacks``, ``chain``, ``chord``) of a worker
    request's message body ({} if it has none, or they cannot be read)."""
    try:
        embed = req._payload[2]
    except (AttributeError, IndexError, TypeError):
        return {}
    return dict(embed) if isinstance(embed, dict) else {}


def live_requests() -> list[Any]:
    """The requests running in this worker now."""
    return list(worker_state.active_requests)


def worker_stopping(controller: Any) -> bool:
    """Whether the worker is shutting down (its pool may run nothing more)."""
    for flag in (worker_state.should_stop, worker_state.should_terminate):
        if flag is not None and flag is not False:  # an exit code, 0 included
            return True
    blueprint = getattr(controller, "blueprint", None)
    state: object = getattr(blueprint, "state", _BLUEPRINT_RUNNING)
    return state != _BLUEPRINT_RUNNING


def run_pending(hub: Any) -> None:
    """Run what is queued in the worker's event loop for its next turn now (acknowledgements,
    above all): a worker that stops leaves its loop without that turn, and closes its
    connection, which gives every message not acknowledged back to the broker."""
    for callback in hub._pop_ready():
        try:
            callback()
        except Exception:  # (one failure must not keep the others back)
            logger.exception("celery_redsem: a callback queued in the event loop failed")


def sweep_unacked(controller: Any) -> None:
    """Give back to their queues the messages a dead worker held unacknowledged for longer than
    the Redis broker's ``visibility_timeout`` (nothing on other brokers).

    kombu's Redis transport does this on a timer of the worker's event loop; a worker without
    one (gevent, eventlet) sweeps only when a poll finds nothing, and its poll always finds the
    answer of its last ``BRPOP`` (every second): it never sweeps, and a killed worker's parked
    tasks would stay unacknowledged until a worker with an event loop came by.
    """
    connection = getattr(getattr(controller, "consumer", None), "connection", None)
    cycle = getattr(getattr(connection, "transport", None), "cycle", None)
    restore = getattr(cycle, "maybe_restore_messages", None)
    if callable(restore):
        restore()


def unwritten_tasks(controller: Any) -> bool:
    """Whether a worker's prefork pool holds tasks not yet written to their children (its
    ``AsynPool``'s outbound buffer; False for any other pool)."""
    pool = getattr(getattr(controller, "pool", None), "_pool", None)
    return bool(getattr(pool, "outbound_buffer", None))


# -- dispatch --------------------------------------------------------------------------------------


def call_once_when_run_ends(req: Any, then: Callable[[], object]) -> None:
    """Call ``then`` once when the run of the request ``req`` ends, however it ends: after its
    ``on_success`` or ``on_failure`` (whichever Celery calls first; a retried or rejected run
    calls one of them too)."""
    ended = False

    def wrap(callback: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            nonlocal ended
            try:
                return callback(*args, **kwargs)
            finally:
                if not ended:
                    ended = True
                    then()

        return wrapped

    req.on_success = wrap(req.on_success)
    req.on_failure = wrap(req.on_failure)


class Slots(Protocol):
    """A worker's pool slots as admission uses them (:class:`SlotQueue`, and the green pools'
    :class:`~celery_redsem.integration.admission.green.GreenSlots`)."""

    @property
    def gated_here(self) -> bool: ...
    @property
    def free(self) -> int: ...
    def take(self, req: Any) -> None: ...
    def give_back(self) -> None: ...
    def give_back_at_end(self, req: Any) -> None: ...
    def __bool__(self) -> bool: ...
    def request_at(self, index: int) -> Any: ...
    def first(self, count: int) -> Iterator[Any]: ...
    def queued_ids(self) -> set[int]: ...
    def put_first(self, req: Any, *, behind: int = 0) -> None: ...
    def remove(self, req: Any) -> bool: ...
    def start_first(self) -> None: ...
    def defer_releases(self, controller: Any, hub: Any, while_: Callable[[], bool]) -> None: ...


def hook_dispatch(
    controller: Any,
    hook: Callable[[Any], Any],
    slots: Slots | None,
    gate: Callable[[Any], Any] | None = None,
) -> Callable[[Any], Any]:
    """Have the worker call ``hook(req)`` where it would hand ``req`` to its pool (with a slot
    of ``slots`` taken, if given); returns the worker's own hand-over, for the hook to call.

    Where the pool does not dispatch by the slots itself (threads: Celery makes the slot
    semaphore and leaves it unused; gevent, eventlet: none), the worker's consumer hands each
    task to ``gate`` (default: the worker's own ``_process_task_sem``), which takes a slot
    first, and a task handed over gives its slot back when it ends. (Called before the
    worker's consumer is made, which takes the worker's ``process_task``.)
    """
    hand_over: Callable[[Any], Any] = controller._process_task
    controller._process_task = hook
    if slots is None or not slots.gated_here:
        return hand_over
    controller.process_task = gate or controller._process_task_sem

    def dispatch(req: Any) -> Any:
        slots.give_back_at_end(req)
        return hand_over(req)

    return dispatch


class SlotQueue:
    """The prefork pool's slots (kombu's ``LaxBoundedSemaphore``) as admission uses them.

    A task takes a slot with :meth:`take`: at once if one is free, else queued, last, to get
    the next one given back. Admission also reads and rearranges the queue of tasks that wait
    for a slot, for the requests it queued with ``process_task`` (its hook).
    """

    def __init__(
        self,
        semaphore: Any,
        process_task: Callable[[Any], Any],
        *,
        gated_here: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._semaphore = semaphore
        self._waiting: deque[Entry] = semaphore._waiting
        self._process_task = process_task
        #: Where the pool does not give a slot back itself: how a task's end, in a pool
        #: thread, gets back to the event loop (the loop's ``call_soon``), else None.
        self._call_in_loop = gated_here

    @property
    def gated_here(self) -> bool:
        """Whether the worker dispatches by these slots for admission (the pool does not)."""
        return self._call_in_loop is not None

    def give_back_at_end(self, req: Any) -> None:
        """Give ``req``'s slot back when its run ends (its pool does not: see
        :func:`hook_dispatch`), in the event loop."""
        call_in_loop = self._call_in_loop
        assert call_in_loop is not None
        call_once_when_run_ends(req, lambda: call_in_loop(self.give_back))

    @property
    def free(self) -> int:
        """How many slots are free now."""
        return int(self._semaphore.value)

    def take(self, req: Any) -> None:
        """``req`` takes a slot: now if one is free (``process_task(req)`` runs), else when
        one is given back."""
        self._semaphore.acquire(self._process_task, req)

    def give_back(self) -> None:
        """Give a slot back (the next task queued for one takes it)."""
        self._semaphore.release()

    def __bool__(self) -> bool:
        """Whether any task waits for a slot."""
        return bool(self._waiting)

    def request_at(self, index: int) -> Any:
        """The request queued at ``index`` (0: first) if admission queued it, else None."""
        callback, args, _kwargs = self._waiting[index]
        return args[0] if callback == self._process_task and len(args) == 1 else None

    def first(self, count: int) -> Iterator[Any]:
        """The requests (None where another callback is queued) among the first ``count``."""
        for index in range(min(count, len(self._waiting))):
            yield self.request_at(index)

    def queued_ids(self) -> set[int]:
        """The ``id()`` of every request queued for a slot."""
        return {id(args[0]) for _cb, args, _kw in self._waiting if args}

    def put_first(self, req: Any, *, behind: int = 0) -> None:
        """Queue ``req`` for the next slot given back, behind the first ``behind`` queued."""
        self._waiting.insert(behind, (self._process_task, (req,), {}))

    def remove(self, req: Any) -> bool:
        """Take ``req`` out of the queue; False if it was not there."""
        for index, (callback, args, _kwargs) in enumerate(self._waiting):
            if callback == self._process_task and len(args) == 1 and args[0] is req:
                del self._waiting[index]
                return True
        return False

    def start_first(self) -> None:
        """Give a free slot to the first task queued (whatever its callback)."""
        callback, args, kwargs = self._waiting.popleft()
        self._semaphore.acquire(callback, *args, **kwargs)

    def defer_releases(self, controller: Any, hub: Any, while_: Callable[[], bool]) -> None:
        """While ``while_()`` holds, a slot given back goes to the next task one event-loop
        step later (see :class:`~celery_redsem.integration.admission.parking.ParkingLot`).

        Both ways Celery gives a slot back are deferred: the semaphore's ``release``, and the
        ``_quick_release`` the worker bound to it as it started (a task revoked as it was
        handed to the pool gives its slot back through that one).
        """
        semaphore = self._semaphore
        if getattr(semaphore, "_redsem_deferred", False):
            return
        release = semaphore.release

        def release_soon() -> None:
            if while_():
                hub.call_soon(release)
            else:
                release()

        semaphore.release = release_soon
        semaphore._redsem_deferred = True
        if getattr(controller, "_quick_release", None) == release:
            controller._quick_release = release_soon


def slot_queue(controller: Any, process_task: Callable[[Any], Any]) -> SlotQueue | None:
    """The worker's slots, if its pool dispatches by them (prefork) or can be made to (threads,
    with an event loop), else None."""
    semaphore = getattr(controller, "semaphore", None)
    if (
        semaphore is None
        or not isinstance(getattr(semaphore, "_waiting", None), deque)
        or getattr(controller, "timer", None) is None
    ):
        return None
    if getattr(controller, "process_task", None) == getattr(
        controller, "_process_task_sem", object()
    ):
        return SlotQueue(semaphore, process_task)
    hub = getattr(controller, "hub", None)
    if hub is not None and isinstance(getattr(controller, "pool", None), ThreadsPool):
        return SlotQueue(semaphore, process_task, gated_here=hub.call_soon)
    return None


def in_loop(controller: Any, slots: Slots | None) -> Callable[[Callable[[], None]], None]:
    """How to run a task's end callback's work in the worker's event loop: at once where the
    pool calls back in the loop (prefork), through the loop's ``call_soon`` where it calls back
    in its own threads (threads)."""
    if slots is not None and slots.gated_here:
        hub_call_soon: Callable[[Callable[[], None]], None] = controller.hub.call_soon
        return hub_call_soon
    return _call_now


def _call_now(fn: Callable[[], None]) -> None:
    fn()


# -- the probe -------------------------------------------------------------------------------------


def versions() -> str:
    """The versions of Celery and kombu installed, for messages."""
    found = []
    for name in ("celery", "kombu"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (version unknown)")
    return ", ".join(found)


def probe(controller: Any) -> list[str]:
    """What admission needs of the worker ``controller`` and does not find there (empty: all is
    as expected). Called once its pool is made (its slot semaphore exists by then)."""
    problems = []
    if not callable(getattr(controller, "_process_task", None)):
        problems.append("the worker has no _process_task to hook")
    if getattr(controller, "process_task", None) is None:
        problems.append("the worker has no process_task")
    semaphore = getattr(controller, "semaphore", None)
    if semaphore is not None and getattr(controller, "_process_task_sem", None) is not None:
        problems += _probe_slots(type(semaphore))
        if not callable(getattr(controller, "_quick_release", None)):
            problems.append("the worker has no _quick_release")
    return problems


def _probe_slots(cls: type) -> list[str]:
    """Drive a throwaway slot semaphore of class ``cls`` through a queue and two releases, as
    admission does, and say what did not behave as expected."""
    started: list[int] = []

    def start(number: int) -> None:
        started.append(number)

    try:
        slots = cls(1)
        waiting = getattr(slots, "_waiting", None)
        if not isinstance(waiting, deque):
            return [f"its slot semaphore ({cls.__qualname__}) keeps no _waiting deque"]
        slots.acquire(start, 1)
        slots.acquire(start, 2)
        queued = list(waiting)
        slots.release()
        after_release = (list(started), len(waiting), slots.value)
        slots.release()
    except Exception as exc:
        return [f"its slot semaphore ({cls.__qualname__}) failed a probe: {exc!r}"]
    if queued != [(start, (2,), {})]:
        return [f"its slot semaphore queues tasks as {queued!r}, not (callback, args, kwargs)"]
    if after_release != ([1, 2], 0, 0) or slots.value != 1:
        return [f"its slot semaphore hands a released slot on unexpectedly: {after_release!r}"]
    return []
