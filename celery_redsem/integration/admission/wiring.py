"""How admission hooks into each pool a Celery user runs.

=========  ===================================================================================
pool       what admission uses
=========  ===================================================================================
prefork    the pool's slot semaphore, which the pool dispatches by; the worker's event loop
threads    the slot semaphore Celery makes and the pool leaves unused, which the worker is made
           to dispatch by (a slot comes back in the event loop when a run ends); the event loop
gevent,    slots counted here and one dispatcher greenlet as the event loop
eventlet   (:mod:`.green`); the worker sweeps for a dead worker's messages on the Redis broker,
           which kombu leaves undone without an event loop
solo       nothing: each task's pool child (the worker itself) asks
=========  ===================================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_redsem.integration import seam
from celery_redsem.integration.admission.green import (
    SWEEP_EVERY,
    GreenLoop,
    GreenSlots,
    green_library,
)
from celery_redsem.integration.seam.broker_poll import PollWake

__all__ = ["Wiring", "wire"]


class Wiring:
    """Admission's hook-up on one worker: its slots (None: none to give out), the worker's
    hand-over to its pool, how work reaches the event loop (``in_loop``) and the timer parked
    tasks resume on (None: the worker's)."""

    def __init__(
        self,
        controller: Any,
        slots: seam.Slots | None,
        dispatch: Callable[[Any], Any],
        in_loop: Callable[[Callable[[], None]], None],
        green_loop: GreenLoop | None = None,
    ) -> None:
        self.controller = controller
        self.slots = slots
        self.dispatch = dispatch
        self.in_loop = in_loop
        self.green_loop = green_loop
        self.timer: Any = green_loop

    def run_pending(self) -> None:
        """The worker stops: run now what waits for the event loop's next turn, or the
        dispatcher greenlet's (acknowledgements of tasks that started, before the connection
        closes: a task whose acknowledgement never went out would run again elsewhere)."""
        if self.green_loop is not None:
            self.green_loop.run_pending()
        elif getattr(self.controller, "hub", None) is not None:
            seam.run_pending(self.controller.hub)


def wire(controller: Any, hook: Callable[[Any], Any]) -> Wiring:
    """Hook ``hook`` into the worker ``controller``'s dispatch, as its pool allows."""
    library = green_library(getattr(controller, "pool", None))
    if library is None:
        slots = seam.slot_queue(controller, hook)
        dispatch = seam.hook_dispatch(controller, hook, slots)
        return Wiring(controller, slots, dispatch, seam.in_loop(controller, slots))
    loop = GreenLoop(library, controller.timer)
    loop.after_work = poll_wake = PollWake(controller)
    green = GreenSlots(controller.pool.limit, hook, loop)

    def received(req: Any) -> None:  # (in the consumer's greenlet)
        poll_wake.install()
        loop.call_soon(green.take, req)

    dispatch = seam.hook_dispatch(controller, hook, green, received)
    loop.start()
    options = getattr(controller.app.conf, "broker_transport_options", None) or {}
    every = options.get("unacked_restore_interval", SWEEP_EVERY)
    controller.timer.call_repeatedly(every, seam.sweep_unacked, (controller,))
    return Wiring(controller, green, dispatch, loop.call_soon, loop)
