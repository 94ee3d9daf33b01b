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

import redis.exceptions as redis_errors

__all__ = [
    "AcquireTimeout",
    "BackendError",
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
    """A task's ``key`` callable raised, or returned something that is not a usable name."""


class BackendError(RedsemError):
    """Redis raised an error or could not be reached; the original is the ``__cause__``."""

    @property
    def transient(self) -> bool:
        """True if the same call can succeed later (see :func:`is_transient`)."""
        return self.__cause__ is None or is_transient(self.__cause__)


class NotEnoughReplicas(BackendError):
    """A grant needed ``min_replicas`` acknowledgements but the primary has fewer replicas.

    The grant was released, so nothing is held. A :class:`BackendError` because it is a state
    of the deployment (no replica configured, or replicas down or resyncing during a
    failover) rather than of the call: under Celery the task is retried, not dropped.
    """

    @property
    def transient(self) -> bool:
        """Always True: replicas come back."""
        return True


class AcquireTimeout(RedsemError):
    """No permit was granted within the allowed time."""


class PermitLost(RedsemError):
    """A permit's lease ended (or it was force-released) while its holder still ran."""


#: Error replies (without an exception class of their own in redis-py) of a server busy
#: running a script, or without the replicas ``min-replicas-to-write`` asks for.
_TRANSIENT_REPLIES = ("BUSY ", "NOREPLICAS ")
#: Refusals that arrive as connection errors but no retry can fix.
_REFUSALS = (redis_errors.AuthenticationError, redis_errors.AuthorizationError)


def is_transient(error: BaseException) -> bool:
    """Whether a Redis error is an outage that can pass, worth retrying the call later.

    True for an unreachable or timed-out server, a cluster or Sentinel failover, a server that
    is loading, busy or out of memory. False for what no retry fixes: a wrong password, a
    missing ACL permission, a bad client option (such as a TLS setting), a script error.
    """
    if isinstance(error, _REFUSALS):
        return False
    if isinstance(
        error,
        redis_errors.ConnectionError
        | redis_errors.TimeoutError
        | redis_errors.ClusterError
        | redis_errors.RedisClusterException
        | redis_errors.TryAgainError
        | redis_errors.AskError
        | redis_errors.ReadOnlyError
        | redis_errors.OutOfMemoryError,
    ):
        return True
    if isinstance(error, redis_errors.ResponseError):
        return str(error).startswith(_TRANSIENT_REPLIES)
    return False
