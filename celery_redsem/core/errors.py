"""Exceptions raised by celery_redsem.

Every exception derives from :class:`RedsemError`, so one ``except RedsemError`` catches them all::

    RedsemError
    ├── ConfigurationError      bad argument or setting (also a ValueError)
    │   └── KeyFunctionError    a task's key function raised or returned garbage
    ├── BackendError            Redis failed or could not be reached
    │   └── NotEnoughReplicas   min_replicas asked for more replicas than the primary has
    ├── AcquireTimeout          no permit within the allowed wait
    ├── Busy                    on_busy="fail": the key was busy, so the run failed at once
    ├── AlreadyQueued           dedupe="raise": a run for the key is already queued or running
    └── PermitLost              a held permit expired or was taken away

Each carries the semaphore name (and permit id where one exists) so a log line says which
limit was involved.
"""

from __future__ import annotations

import redis.exceptions as redis_errors

from celery_redsem.core.connections import error_code

__all__ = [
    "REDIS_ERRORS",
    "AcquireTimeout",
    "AlreadyQueued",
    "BackendError",
    "Busy",
    "ConfigurationError",
    "KeyFunctionError",
    "NotEnoughReplicas",
    "PermitLost",
    "RedsemError",
    "is_transient",
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
    """A task's ``key`` (or ``limit``) callable raised, or returned something that is not a
    usable name (or limit)."""


class BackendError(RedsemError):
    """Redis raised an error or could not be reached; the original is the ``__cause__``."""

    @property
    def transient(self) -> bool:
        """True if the same call can succeed later (see :func:`is_transient`)."""
        return self.__cause__ is None or is_transient(self.__cause__)


class NotEnoughReplicas(BackendError):
    """A grant needed ``min_replicas`` acknowledgements but the primary has fewer replicas.

    A new grant was released, so nothing is held (a renewal is left as it was). A
    :class:`BackendError` because it is a state of the deployment (no replica configured, or
    replicas down or resyncing during a failover) rather than of the call: under Celery the
    task is retried, not dropped.
    """

    @property
    def transient(self) -> bool:
        """Always True: replicas come back."""
        return True


class AcquireTimeout(RedsemError):
    """No permit was granted within the allowed time."""


class Busy(RedsemError):
    """A task with ``on_busy="fail"`` found its key busy (no permit free): it did not run."""


class AlreadyQueued(RedsemError):
    """A task with ``dedupe="raise"`` was sent while a run for its key is queued or running.

    ``task_id`` is that run's id (``AsyncResult(exc.task_id)`` follows it).
    """

    def __init__(self, message: str, *, name: str | None = None, task_id: str | None = None):
        super().__init__(message, name=name, permit_id=task_id)
        self.task_id = task_id


class PermitLost(RedsemError):
    """A permit's lease ended (or it was force-released) while its holder still ran."""


#: Errors no retry can fix: a wrong password, a missing ACL permission, keys split across
#: slots, input the client refuses to send.
_REFUSALS = (
    redis_errors.AuthenticationError,
    redis_errors.AuthenticationWrongNumberOfArgsError,
    redis_errors.AuthorizationError,
    redis_errors.NoPermissionError,
    redis_errors.ClusterCrossSlotError,
    redis_errors.DataError,
)
#: Error reply codes no retry can fix: a generic error (a script error, an unknown command), a
#: key of the wrong type, keys split across slots (redis-py before 7.2 has no class for it).
_REFUSED_CODES = frozenset({"ERR", "WRONGTYPE", "CROSSSLOT"})
#: Everything redis-py raises for a call that did not go through (``RedisClusterException``
#: is not a ``RedisError``: a cluster whose layout cannot be learnt, a slot nobody serves).
REDIS_ERRORS = (redis_errors.RedisError, redis_errors.RedisClusterException)


def is_transient(error: BaseException) -> bool:
    """Whether a Redis error is an outage that can pass, worth retrying the call later.

    False for what no retry fixes, also when it is the cause of another error (a cluster that
    cannot be reached because every node refused the password): a wrong password, a missing
    ACL permission, a generic ``ERR`` reply (a script error, an unknown command), a
    ``WRONGTYPE`` key, a client option redis-py rejects. True for the rest: an unreachable or
    timed-out server, a failover, a server loading, busy, out of memory, unable to persist
    (``MISCONF``), short of replicas, and error replies it does not know.
    """
    cause: BaseException | None = error
    for _ in range(8):  # the chain of causes, bounded
        if cause is None:
            break
        if isinstance(cause, _REFUSALS):
            return False
        cause = cause.__cause__
    if isinstance(error, redis_errors.ResponseError):
        return error_code(error) not in _REFUSED_CODES
    return isinstance(
        error,
        redis_errors.ConnectionError
        | redis_errors.TimeoutError
        | redis_errors.ClusterError
        | redis_errors.RedisClusterException,
    )
