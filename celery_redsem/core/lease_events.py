"""Listeners told when a held permit's lease is lost: the heartbeat found it expired or gone,
or the release found it no longer held (each loss is told once).

The core does not know who listens; :mod:`celery_redsem.metrics` counts losses
this way. A listener runs in the thread that found the loss (often the heartbeat's): keep it
quick. One that raises is logged and does not stop the others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

__all__ = ["LostPermit", "add_loss_listener", "notify_loss", "remove_loss_listener"]

logger = logging.getLogger(__name__)


class LostPermit(Protocol):
    """What a listener learns of a lost permit (a :class:`~celery_redsem.HeldPermit`)."""

    task_name: str

    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...


LossListener = Callable[[LostPermit], None]

_lock = threading.Lock()
_listeners: tuple[LossListener, ...] = ()


def add_loss_listener(listener: LossListener) -> None:
    """Call ``listener(held)`` on every lease loss in this process from now on."""
    global _listeners  # noqa: PLW0603
    with _lock:
        if listener not in _listeners:
            _listeners = (*_listeners, listener)


def remove_loss_listener(listener: LossListener) -> None:
    """Stop calling ``listener`` (nothing happens if it was not added)."""
    global _listeners  # noqa: PLW0603
    with _lock:
        _listeners = tuple(known for known in _listeners if known != listener)


def notify_loss(held: LostPermit) -> None:
    """Tell every listener that ``held`` lost its lease."""
    for listener in _listeners:
        try:
            listener(held)
        except Exception:
            logger.exception("celery_redsem: a lease-loss listener failed")
