"""Exceptions raised by celery_redsem.

Every exception derives from :class:`RedsemError`, so one ``except RedsemError`` catches them all::

    RedsemError
    ├── ConfigurationError      bad argument or setting (also a ValueError)
    │   └── KeyFunctionError    a task's key function raised or returned garbage
    ├── BackendError            Redis failed or could not be reached
    │   └── NotEnoughReplicas   min_replicas asked for more replicas than the primary has
    ├── AcquireTimeout          no permit within the allowed wait
    └── PermitLost              a held permit expired or was taken away

Each carries the semaphore name (and permit id where one exists) so a log line says which
limit was involved.
"""

from __future__ import annotations

__all__ = [
    "AcquireTimeout",
    "BackendError",
    "ConfigurationError",
    "KeyFunctionError",
    "NotEnoughReplicas",
    "PermitLost",
    "RedsemError",
]


class RedsemError(Exception):
    """Base class of every error this package raises."""

    def __init__(self, message: str, *, name: str | None = None, permit_id: str | None = None):
        super().__init__(message)
        self.name = name
        self.permit_id = permit_id


class ConfigurationError(RedsemError, ValueError):
    """An argument or a ``redsem_*`` setting is invalid."""


class KeyFunctionError(ConfigurationError):
    """A task's ``key`` callable raised, or returned something that is not a usable name."""


class BackendError(RedsemError):
    """Redis raised an error or could not be reached; the original is the ``__cause__``."""


class NotEnoughReplicas(BackendError):
    """A grant needed ``min_replicas`` acknowledgements but the primary has fewer replicas.

    The grant was released, so nothing is held. A :class:`BackendError` because it is a state
    of the deployment (no replica configured, or replicas down or resyncing during a
    failover) rather than of the call: under Celery the task is retried, not dropped.
    """


class AcquireTimeout(RedsemError):
    """No permit was granted within the allowed time."""


class PermitLost(RedsemError):
    """A permit's lease ended (or it was force-released) while its holder still ran."""
