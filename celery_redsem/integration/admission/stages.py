"""The record admission keeps of one guarded request while it decides, and its stages.

A request asked for at dispatch is a :class:`Candidate` until it is dispatched (with or without
its permit), parked or sent to its pool slot as a standby. Two small enums say where it is:

* :class:`Stage`, its pool slot: asked for ahead of the slot (``AHEAD``), its answer kept until
  it takes the slot (``KEPT``), given up because it will not take a slot here (``DROPPED``),
  holding its slot (``SLOTTED``), or decided (``DONE``).
* :class:`Then`, what the next answer is for: the first ask (``FIRST``), the ask that told
  Redis when the task will be back, after which it parks (``PARK``), or nothing: the task goes
  to its child once it holds its slot (``TO_CHILD``).

:class:`PermitGuard` is what admission asks of a task's one guard when it is a semaphore's
(:mod:`~celery_redsem.integration.guards`; a rate limiter's: :class:`.parking.RateGuard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Protocol

from celery import Celery

from celery_redsem.core.semaphore import FairSemaphore
from celery_redsem.integration.admission.parking import Parked
from celery_redsem.integration.line import Answer
from celery_redsem.integration.settings import RedsemConfig

__all__ = ["Answer", "Candidate", "PermitGuard", "Stage", "Then"]


class Stage(Enum):
    """Where a candidate stands with its pool slot."""

    AHEAD = auto()  # asked for ahead of its slot; no answer acted on yet
    KEPT = auto()  # asked ahead; its answer is kept until it takes its slot
    DROPPED = auto()  # asked ahead; it will not take a slot here (its grant goes back)
    SLOTTED = auto()  # holds its slot
    DONE = auto()  # dispatched, parked or standing by


class Then(Enum):
    """What the next answer for a candidate is for."""

    FIRST = auto()  # its ask: a permit, or its place in line to decide on
    PARK = auto()  # the ask that told Redis when it will be back: park it (unless granted)
    TO_CHILD = auto()  # none: it goes to its child once it holds its slot


class PermitGuard(Protocol):
    """What admission asks of a semaphore guard."""

    def naming_for(
        self, task_name: str, args: tuple[Any, ...], kwargs: Any
    ) -> tuple[str, int, tuple[str, float] | None]: ...

    def semaphore(
        self,
        app: Celery,
        name: str,
        config: RedsemConfig | None = None,
        limit: int | None = None,
        share: tuple[str, float] | None = None,
    ) -> FairSemaphore: ...

    def max_wait_for(self, app_max_wait: float | None) -> float | None: ...


@dataclass
class Candidate:
    """A guarded request admission is asking for, until it is dispatched or parked."""

    req: Any
    guard: PermitGuard
    earlier: Parked | None  # how it was parked before, if it was
    sem: FairSemaphore
    run: str  # its permit id
    config: RedsemConfig
    hold: float | None  # the hold time learnt for its task
    longest: float  # how long its delivery may stay parked
    connection: Any  # the consumer's broker connection when it was asked for
    stage: Stage = Stage.SLOTTED
    then: Then = Then.FIRST
    lease: float = 0.0  # the waiter lease and back_in of the latest ask
    back_in: float = 0.0
    asked: float = 0.0  # monotonic time of the latest ask
    kept: Answer | None = None  # (Stage.KEPT) the answer kept for its slot, and since when
    kept_at: float = 0.0
    parked: Parked | None = None  # (Then.PARK) how it will be parked, and for how long
    park_for: float = 0.0

    @property
    def slotted(self) -> bool:
        """Whether it holds its pool slot now."""
        return self.stage is Stage.SLOTTED
