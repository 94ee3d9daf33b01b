"""A permit granted in a prefork worker's main process, handed to the pool child that runs the task.

:mod:`~celery_redsem.integration.admission.dispatcher` asks for a task's permit before the task
takes a pool
slot;
the child then need not ask again. The grant travels in the request the child receives, under
:data:`GRANT_FIELD`, with a secret drawn in the main process before the pool forks: children
inherit it, nobody else knows it, so a message header cannot forge a grant. The main process
sets the field on every dispatch (and removes a stale one); the child removes it when it takes
the grant over, so no retry or later delivery can carry it.
"""

from __future__ import annotations

import os
from contextlib import suppress
from typing import Any

from celery_redsem.core.permit_ids import permit_id_of
from celery_redsem.core.permits import Permit

__all__ = ["GRANT_FIELD", "clear_grant", "hand_over", "take_over"]

#: Field of the request dict that carries a handed-over grant to the pool child.
GRANT_FIELD = "redsem_grant"

_SECRET = os.urandom(16).hex()


def hand_over(request_dict: dict[str, Any], permit: Permit, granted_at: float) -> None:
    """Put ``permit`` (granted at monotonic time ``granted_at``) in a request for its child."""
    request_dict[GRANT_FIELD] = [
        _SECRET,
        permit.id,
        permit.name,
        permit.prefix,
        permit.token,
        permit.expires_at,
        granted_at,
    ]


def clear_grant(request_dict: dict[str, Any]) -> None:
    """Remove any grant from a request (before the main process decides afresh)."""
    request_dict.pop(GRANT_FIELD, None)


def take_over(request: Any, name: str, prefix: str, lease: float) -> tuple[Permit, float] | None:
    """The permit handed over for this run of ``request`` on semaphore ``name``, with the
    monotonic time it was granted; None if there is none (or it is not for this semaphore).

    The field is removed (also from the request's headers), so nothing built from the request
    later, such as a retry's message, can carry it.
    """
    value = getattr(request, GRANT_FIELD, None)
    if value is None:
        return None
    with suppress(AttributeError):
        delattr(request, GRANT_FIELD)
    headers = getattr(request, "headers", None)  # Celery copies unknown fields there too,
    if isinstance(headers, dict):  # and self.retry() would publish them with the secret
        headers.pop(GRANT_FIELD, None)
    if not isinstance(value, list | tuple) or len(value) != 7:
        return None
    secret, permit_id, granted_name, granted_prefix, token, expires_at, granted_at = value
    if (
        secret != _SECRET
        or permit_id != permit_id_of(request)
        or granted_name != name
        or granted_prefix != prefix
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in (token, expires_at))
        or not isinstance(granted_at, float)
    ):
        return None
    return Permit(permit_id, name, token, expires_at, lease, prefix), granted_at
