"""celery_redsem: a Redis-backed fair semaphore and lock for Celery tasks.

The core (:class:`FairSemaphore`, :class:`Lock`) works with any redis-py client, with or
without Celery.
"""

from __future__ import annotations

from .core.errors import (
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    KeyFunctionError,
    NotEnoughReplicas,
    PermitLost,
    RedsemError,
)
from .core.heartbeat import HeldPermit
from .core.permits import HolderInfo, Permit, RefreshResult, SemaphoreState, WaiterInfo, Waiting
from .core.semaphore import FairSemaphore, Lock, read_state, refresh_permits
from .integration.config import RedsemConfig, get_client, get_config
from .integration.decorators import current_permit, with_lock, with_semaphore

__version__ = "0.1.0"

__all__ = [
    "AcquireTimeout",
    "BackendError",
    "ConfigurationError",
    "FairSemaphore",
    "HeldPermit",
    "HolderInfo",
    "KeyFunctionError",
    "Lock",
    "NotEnoughReplicas",
    "Permit",
    "PermitLost",
    "RedsemConfig",
    "RedsemError",
    "RefreshResult",
    "SemaphoreState",
    "WaiterInfo",
    "Waiting",
    "__version__",
    "current_permit",
    "get_client",
    "get_config",
    "read_state",
    "refresh_permits",
    "with_lock",
    "with_semaphore",
]
