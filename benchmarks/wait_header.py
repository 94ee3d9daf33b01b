"""The one place the benchmarks read celery_redsem's wait header (``redsem_wait``): how many
times a guarded run went back through the broker for its permit.

The header's name and reader are internal to celery_redsem
(:mod:`celery_redsem.integration.waiting`); both benchmark apps read it through here, so when
a public way to read it comes, only this module changes.
"""

from __future__ import annotations

from typing import Any

from celery_redsem.integration.waiting import WAIT_HEADER, read_wait

__all__ = ["header_attempts", "wait_attempts"]


def header_attempts(request: Any) -> Any:
    """The first element of ``request``'s wait header as the message carries it (attempts so
    far), 0 without one: what the Celery benchmark's records count as re-publishes."""
    wait = getattr(request, WAIT_HEADER, None) or (request.headers or {}).get(WAIT_HEADER)
    return (wait or [0])[0]


def wait_attempts(request: Any) -> int:
    """The attempts celery_redsem itself reads from ``request``'s wait header (0 for a header
    it takes as stale or malformed): the rate benchmark's trips through the broker."""
    return read_wait(request).attempts
