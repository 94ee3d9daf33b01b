"""A worker without an event loop (gevent, eventlet) woken from its poll of the Redis broker
when its prefetch window frees.

That worker's consumer polls in a plain loop (``drain_events(timeout=2.0)``). With its window
full, kombu's Redis transport stops asking for messages: it polls only its broadcast channel,
or, with nothing else to poll, sleeps a second. A task that starts (acknowledged) or is parked
(the window widened for it) frees the window meanwhile, but the wait went on to its end before
the next fetch: a burst on one key stalled about 1.9 s every 20 starts on a worker of 4 (10
starts a second, against 140 now).

So the consumer's poller is wrapped (:class:`PollWake`, installed as the consumer hands a task
over, so its next wait is wakeable): a wait begun with the window full also waits on a pipe of
ours, which admission writes once the window frees (it checks after each piece of its work).
Nothing on other brokers: RabbitMQ sends as soon as the window frees.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import weakref
from collections.abc import Callable
from typing import Any

from kombu.transport.virtual import Transport as VirtualTransport
from kombu.utils.eventio import READ

__all__ = ["PollWake"]

logger = logging.getLogger(__name__)

#: What the wakeable poll uses of kombu's ``MultiChannelPoller`` (Redis).
_NEEDED = ("poller", "on_poll_start", "_paused_brpop", "fds")

#: The longest kombu's Redis transport sleeps with nothing to poll (its ``get``).
_KOMBU_NAP = 1.0


class PollWake:
    """Installs the wakeable poll on a worker's consumer, and wakes it when the window frees."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller
        self._warned = False

    def install(self) -> _WakeablePoll | None:
        """The consumer's wakeable poll, installed now if it is not yet (None on a broker other
        than kombu's Redis transport, or before the consumer is connected)."""
        consumer = getattr(self._controller, "consumer", None)
        transport = getattr(getattr(consumer, "connection", None), "transport", None)
        cycle = getattr(transport, "cycle", None)
        installed = getattr(cycle, "redsem_poll", None)
        if isinstance(installed, _WakeablePoll) or cycle is None:
            return installed
        channel = getattr(getattr(consumer, "task_consumer", None), "channel", None)
        can_consume = getattr(getattr(channel, "qos", None), "can_consume", None)
        if not isinstance(transport, VirtualTransport) or can_consume is None:
            return None
        missing = [name for name in _NEEDED if not hasattr(cycle, name)]
        if missing:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "celery_redsem: kombu's %s has no %s: a green worker's poll of the broker "
                    "is not woken when its prefetch window frees (bursts may stall up to 2 s)",
                    type(cycle).__name__,
                    ", ".join(missing),
                )
            return None
        cycle.redsem_poll = wakeable = _WakeablePoll(cycle, can_consume)
        return wakeable

    def __call__(self) -> None:
        """The window may have freed (a task acknowledged, the window widened for a parked
        one): apply a changed window, and wake a wait begun without one."""
        wakeable = self.install()
        if wakeable is not None:
            qos = self._controller.consumer.qos
            if qos.prev != qos.value:
                qos.update()  # (on kombu's virtual transports: an assignment, no round trip)
            wakeable.wake_if_freed()


class _WakeablePoll:
    """The waits of one kombu Redis ``cycle`` (its ``MultiChannelPoller``), made wakeable: its
    poller is wrapped, and its sleep with nothing to poll becomes a wait on the pipe."""

    def __init__(self, cycle: Any, can_consume: Callable[[], bool]) -> None:
        self._can_consume = can_consume
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        weakref.finalize(self, _close_fds, self._read, self._write)
        self._starved = False  # a wait began with the window full and goes on
        self._poller = cycle.poller
        self._poller.register(self._read, READ)
        cycle.poller = _Poller(self)
        on_poll_start = cycle.on_poll_start

        def wake_before_nap() -> None:
            on_poll_start()
            # kombu sleeps next if the window is full and nothing else is polled: wait here
            # instead, and let it ask for messages again if the window freed meanwhile.
            if cycle._paused_brpop and not cycle.fds and self.nap(_KOMBU_NAP):
                on_poll_start()

        cycle.on_poll_start = wake_before_nap

    def poll(self, timeout: float | None) -> list[tuple[int, int]] | None:
        """kombu's poll, also ended by a wake-up (returning no event for it)."""
        self._starved = not self._can_consume()
        try:
            events: list[tuple[int, int]] | None = self._poller.poll(timeout)
        finally:
            self._starved = False
        if events and any(fd == self._read for fd, _ in events):
            self._drain()
            events = [(fd, event) for fd, event in events if fd != self._read]
        return events

    def nap(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the window to free; True if it did."""
        self._starved = not self._can_consume()
        if not self._starved:
            return True
        try:
            woken = select.select([self._read], [], [], seconds)[0]
        finally:
            self._starved = False
        self._drain()
        return bool(woken)

    def wake_if_freed(self) -> None:
        """End a wait begun with the window full, if it has freed."""
        if self._starved and self._can_consume():
            self._starved = False  # (one byte a wait)
            with contextlib.suppress(BlockingIOError):
                os.write(self._write, b"!")

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 64)


class _Poller:
    """kombu's poller with :meth:`_WakeablePoll.poll` in place of its own."""

    def __init__(self, wakeable: _WakeablePoll) -> None:
        self._wakeable = wakeable

    def poll(self, timeout: float | None) -> list[tuple[int, int]] | None:
        events: list[tuple[int, int]] | None = self._wakeable.poll(timeout)
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wakeable._poller, name)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
