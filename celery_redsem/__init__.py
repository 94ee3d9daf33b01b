"""celery_redsem: a Redis-backed fair semaphore and lock for Celery tasks.

The core (:class:`FairSemaphore`, :class:`Lock`, in :mod:`celery_redsem.core`) works with any
redis-py client, with or without Celery: importing it does not import Celery. The Celery names
(the decorators, the settings) load on first use.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from celery_redsem.core.errors import (
    AcquireTimeout,
    AlreadyQueued,
    BackendError,
    Busy,
    ConfigurationError,
    KeyFunctionError,
    NotEnoughReplicas,
    PermitLost,
    RedsemError,
)
from celery_redsem.core.heartbeat import HeldPermit
from celery_redsem.core.permits import (
    HolderInfo,
    Permit,
    RefreshResult,
    SemaphoreState,
    WaiterInfo,
    Waiting,
)
from celery_redsem.core.rate_limit import RateLimiter, RateResult, RateState
from celery_redsem.core.refresh import refresh_permits
from celery_redsem.core.semaphore import FairSemaphore, Lock
from celery_redsem.core.state import read_state

if _TYPE_CHECKING:
    from celery_redsem.integration.dedupe.sender import install_dedupe
    from celery_redsem.integration.guards.decorators import (
        current_permit,
        current_rate_limiter,
        with_lock,
        with_rate_limit,
        with_semaphore,
    )
    from celery_redsem.integration.guards.rate_guard import pause_and_retry
    from celery_redsem.integration.settings import RedsemConfig, get_client, get_config
    from celery_redsem.integration.settings import reset as reset_config
    from celery_redsem.integration.wire import contention_retries

__version__ = "0.1.0"

#: Names that need Celery, by the module that defines them: imported on first access, so
#: ``import celery_redsem.core`` (which runs this file first) stays free of Celery.
_CELERY_NAMES = {
    "RedsemConfig": "celery_redsem.integration.settings",
    "get_client": "celery_redsem.integration.settings",
    "get_config": "celery_redsem.integration.settings",
    "contention_retries": "celery_redsem.integration.wire",
    "current_permit": "celery_redsem.integration.guards.decorators",
    "current_rate_limiter": "celery_redsem.integration.guards.decorators",
    "install_dedupe": "celery_redsem.integration.dedupe.sender",
    "pause_and_retry": "celery_redsem.integration.guards.rate_guard",
    "reset_config": "celery_redsem.integration.settings",
    "with_lock": "celery_redsem.integration.guards.decorators",
    "with_rate_limit": "celery_redsem.integration.guards.decorators",
    "with_semaphore": "celery_redsem.integration.guards.decorators",
}

#: Names that differ from the name in their module.
_ALIASES = {"reset_config": "reset"}


def __getattr__(name: str) -> _Any:
    module = _CELERY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_redsem' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), _ALIASES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_CELERY_NAMES))


__all__ = [
    "AcquireTimeout",
    "AlreadyQueued",
    "BackendError",
    "Busy",
    "ConfigurationError",
    "FairSemaphore",
    "HeldPermit",
    "HolderInfo",
    "KeyFunctionError",
    "Lock",
    "NotEnoughReplicas",
    "Permit",
    "PermitLost",
    "RateLimiter",
    "RateResult",
    "RateState",
    "RedsemConfig",
    "RedsemError",
    "RefreshResult",
    "SemaphoreState",
    "WaiterInfo",
    "Waiting",
    "__version__",
    "contention_retries",
    "current_permit",
    "current_rate_limiter",
    "get_client",
    "get_config",
    "install_dedupe",
    "pause_and_retry",
    "read_state",
    "refresh_permits",
    "reset_config",
    "with_lock",
    "with_rate_limit",
    "with_semaphore",
]
