"""The consumer's prefetch window while tasks are parked: widened as for ETA tasks.

A parked task's message stays unacknowledged, so it counts against the worker's prefetch
window; :func:`widen_for_parked` widens the window (kombu's ``QoS``) for parked tasks, so the
worker keeps fetching the tasks behind them, and narrows it back as they leave.
"""

from __future__ import annotations

import weakref
from typing import Any

from kombu.transport.virtual import Transport as VirtualTransport

__all__ = ["WINDOW_STEP", "widen_for_parked", "window_step"]


#: On a broker that keeps the prefetch window itself (RabbitMQ), the window widens for parked
#: tasks this many messages at a time, and narrows back a step at a time (all of the way once
#: none is parked): each change is a ``basic.qos`` round trip in the event loop, which one
#: change per parked task would spend on every task of a deep line. Where kombu keeps the
#: window in the worker (Redis, SQS: no round trip), it follows the parked tasks one by one.
WINDOW_STEP = 8

_widened: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def window_step(connection: Any) -> int:
    """How many messages at a time the prefetch window of ``connection`` changes for parked
    tasks: 1 on kombu's virtual transports, :data:`WINDOW_STEP` on the others."""
    transport = getattr(connection, "transport", None)
    return 1 if transport is None or isinstance(transport, VirtualTransport) else WINDOW_STEP


def widen_for_parked(qos: Any, change: int, step: int) -> None:
    """One more (``change`` 1) or one fewer (-1) task parked on the consumer's prefetch window
    ``qos`` (a kombu ``QoS``): widen or narrow it in ``step``s, so that it holds the parked
    tasks and as many messages beside them as before (up to ``2 * step - 2`` more)."""
    counts = _widened.setdefault(qos, [0, 0])  # tasks parked on it, messages it was widened
    counts[0] = parked = max(0, counts[0] + change)
    widened = counts[1]
    if parked > widened:
        change = step
    elif parked == 0 and widened:
        change = -widened
    elif widened - parked >= 2 * step - 1:
        change = -step
    else:
        return
    before = qos.value
    if change > 0:
        qos.increment_eventually(change)  # (kombu caps it at the worker's eta task limit)
    else:
        qos.decrement_eventually(-change)  # (and never below 1)
    counts[1] = widened + (qos.value - before if before else change)
