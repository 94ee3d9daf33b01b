"""kombu's slot semaphore as a later kombu might keep it: its queue under another name than
``_waiting`` (what admission relies on). :mod:`.changed_internals_app` runs a worker with it."""

from __future__ import annotations

from kombu.asynchronous.semaphore import LaxBoundedSemaphore

__all__ = ["RenamedSlots"]


class RenamedSlots(LaxBoundedSemaphore):
    """kombu's slot semaphore, working as ever, with its queue under ``_queue``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self._queue = self.__dict__.pop("_waiting")  # (_add_waiter and _pop_waiter keep it)

    def clear(self) -> None:
        self._queue.clear()
        self.value = self.initial_value

    def __repr__(self) -> str:
        return f"<RenamedSlots value:{self.value} waiting:{len(self._queue)}>"
